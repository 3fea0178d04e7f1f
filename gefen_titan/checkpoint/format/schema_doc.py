"""The format's key tables as ``docs/checkpoint_format.md`` shows them: per version, each key
pattern (``schema.PATTERNS``), its value and who writes it.

Kept apart from ``schema`` (the keys, records and checks) because only the
doc and its test read it; ``tests/unit/test_checkpoint_format_doc.py``
fails when the doc's tables and these rows differ.
"""

from __future__ import annotations

from gefen_titan.checkpoint.format import digests, schema

__all__ = ["KEYS", "file_table", "key_table"]

_RECORD = ('str (json): "blocking", "deterministic", "global_step", and per parameter in order: "fqn", "shape", '
           '"period" (0: no state yet), "step", "vmean_step", "group" (lr, beta1, beta2, eps, weight_decay)')
_MUON_ROWS = [
    ("muon", 'str (json): "kind" ("GefenMuon"), "blocking", "deterministic", "global_step", and per parameter in '
     'order: "fqn", "shape", "period" (0: no state yet), "step", "rows_step" (NorMuon\'s counter, 0: no '
     'rows), "group" (lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn, '
     "normuon, normuon_beta2, normuon_eps)", "every rank of the optimizer (same)"),
    ("muon_codebook", "fp32 [256], sorted, ends -1 and +1; the GefenMuon optimizers' one codebook "
     "for the whole job", "every rank of the optimizer (same)"),
    ("muon_codes", "uint8, the GefenMuon parameter's shape and placements", "DTensor: each its shard"),
    ("muon_magnitude", "fp32, the block grid with the parameter's placements", "DTensor: each its shard"),
    ("muon_rows", "fp32 [rows]: NorMuon's per-row second moment, placed like the parameter's dim 0 (when "
     "rows_step > 0); [experts, rows] for a grouped experts' weight (E, out, in), placed like its dims 0 and 1",
     "DTensor: each its shard"),
]
_RAW = " Stored as raw bytes (little-endian, no framing; see *Raw entries*)."

# version -> [(key pattern, value, written by)]; the doc's tables are these rows.
KEYS: dict[int, list[tuple[str, str, str]]] = {
    3: [(schema.PATTERNS[kind], value, by) for kind, value, by in [
        ("header", 'str (json) {"format": "gefen-titan", "version": 3, "blocking": "agreed"}', "every rank (same)"),
        ("gefen", _RECORD, "every rank of the optimizer (same)"),
        ("codebook", "fp32 [256], sorted, ends -1 and +1; one codebook for the whole job",
         "every rank of the optimizer (same)"),
        ("qcodes", "uint8, the parameter's shape and placements." + _RAW, "DTensor: each its shard"),
        ("grid", "fp32, the block grid (shape[:-1] + (shape[-1] / period,)) + (2,): [..., 0] the per-block "
         "magnitude, [..., 1] the per-block vmean, with the parameter's placements." + _RAW,
         "DTensor: each its shard"),
        *_MUON_ROWS,
    ]],
    2: [(schema.PATTERNS[kind], value, by) for kind, value, by in [
        ("header", 'str (json) {"format": "gefen-titan", "version": 2, "blocking": "agreed"}', "every rank (same)"),
        ("gefen", _RECORD, "every rank of the optimizer (same)"),
        ("codebook", "fp32 [256], sorted, ends -1 and +1; one codebook for the whole job",
         "every rank of the optimizer (same)"),
        ("codes", "uint8, the parameter's shape and placements", "DTensor: each its shard"),
        ("magnitude", "fp32, the block grid (shape[:-1] + (shape[-1] / period,)) with the parameter's placements",
         "DTensor: each its shard"),
        ("vmean", "fp32, the block grid with the parameter's placements", "DTensor: each its shard"),
        *_MUON_ROWS,
    ]],
    1: [(schema.PATTERNS[kind], value, by) for kind, value, by in [
        ("header", 'str (json) {"format": "gefen-titan", "version": 1} (newer writers add '
         '"blocking": "per_rank")', "every rank (same)"),
        ("gefen", "str (json): nshards, and per parameter in order: fqn, global shape, "
         "group hyperparameters", "every rank of the optimizer (same)"),
        ("codes", "uint8, the parameter's global shape and placements", "DTensor: each its shard"),
        ("records", "int64 [1 + P, 7]: row 0 = global step, P; row 1 + i = parameter i's "
         "start, length, period, step, vmean_step, first block, number of blocks", "rank r"),
        ("blocks", "fp32 [blocks, 2]: magnitude, vmean, all parameters of the optimizer "
         "back to back", "rank r"),
        ("rank_codebook", "fp32 [256], sorted, ends -1 and +1", "rank r"),
    ]],
}


def key_table(version: int) -> str:
    """The markdown key table of a version, as ``docs/checkpoint_format.md`` shows it."""
    rows = ["| key | value | written by |", "|---|---|---|"]
    rows += [f"| `{key}` | {value} | {by} |" for key, value, by in KEYS[version]]
    return "\n".join(rows)


def file_table() -> str:
    """``docs/checkpoint_format.md``'s table of the ``.digests`` file, generated from ``digests``' constants."""
    algo, md = digests.ALGORITHM, digests.METADATA_FILE
    rows = [
        ("line 1", f"`{digests.MAGIC} {digests.FILE_VERSION} {algo} <hex>`",
         "format name, version, algorithm, and the digest of line 2 (the index); saved with a key "
         f"(`checkpoint.digest_key_env`) the algorithm is `{digests.KEYED_ALGORITHM}` and every digest of the file "
         "is a MAC"),
        ("line 2: `metadata.size`, `metadata.digest`", "int, hex", f"size and {algo} of `{md}`"),
        ("line 2: `files[file]`", "`[start, length, rows, hex]`",
         "where the data file's section lies (counted from the first byte after line 2), its row count and its "
         f"{algo}"),
        ("each section: one line per item", "`<offset> <length> <hex>`",
         f"the {algo} of the item's stored bytes, named by file and offset as `{md}` names it; "
         "sections in the index's order, rows by offset"),
    ]
    return "\n".join(["| field | value | what |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)])
