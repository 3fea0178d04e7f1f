"""Key layout of Gefen state in a DCP checkpoint (format ``gefen-titan``).

All keys sit under the optimizer's entry (torchtitan: ``optimizer.``). ``fqn``
is a parameter's canonical name, ``opt`` the first parameter name of the Gefen
optimizer that owns it (unique across pipeline stages). ``KEYS`` below is the
one definition of both versions: the code builds every key from it and
``docs/checkpoint_format.md`` is checked against it by
``tests/test_checkpoint_format_doc.py``.

Version 2 (agreed blocking, the default) is mesh-invariant: the codebook and
the periods are the same on every rank, so every tensor is saved as a DTensor
with the parameter's own placements (the codes on the parameter's shape, the
per-block magnitude and ``vmean`` on the *block grid*: the shape with the
last dimension divided by the period) and DCP reshards all of it at any
layout. A load is DCP plus views, nothing is recomputed.

Version 1 (per-rank blocking) keeps each rank's own codebook and periods;
its loads re-block and requantize where the layout changed (``adapter.py``).
"""

from __future__ import annotations

K = 256  # codebook entries (gefen-x: num_codebooks=256)
FORMAT = "gefen-titan"
VERSION = 2  # written by agreed blocking
V1 = 1  # written by per-rank blocking
PREFIX = "gefen/"

# version -> [(key pattern, value, written by)]; the doc's tables are these rows.
KEYS: dict[int, list[tuple[str, str, str]]] = {
    2: [
        ("gefen/format", 'str (json) {"format": "gefen-titan", "version": 2, "blocking": "agreed"}',
         "every rank (same)"),
        ("gefen/optimizer/{opt}",
         'str (json): "blocking", "deterministic", "global_step", and per parameter in order: '
         '"fqn", "shape", "period" (0: no state yet), "step", "vmean_step", "group" (lr, beta1, '
         "beta2, eps, weight_decay)", "every rank of the optimizer (same)"),
        ("gefen/codebook/{opt}", "fp32 [256], sorted, ends -1 and +1; one codebook for the whole job",
         "every rank of the optimizer (same)"),
        ("gefen/codes/{fqn}", "uint8, the parameter's shape and placements", "DTensor: each its shard"),
        ("gefen/magnitude/{fqn}", "fp32, the block grid (shape[:-1] + (shape[-1] / period,)) with the "
         "parameter's placements", "DTensor: each its shard"),
        ("gefen/vmean/{fqn}", "fp32, the block grid with the parameter's placements", "DTensor: each its shard"),
    ],
    1: [
        ("gefen/format", 'str (json) {"format": "gefen-titan", "version": 1} (newer writers add '
         '"blocking": "per_rank")', "every rank (same)"),
        ("gefen/optimizer/{opt}", "str (json): nshards, and per parameter in order: fqn, global shape, "
         "group hyperparameters", "every rank of the optimizer (same)"),
        ("gefen/codes/{fqn}", "uint8, the parameter's global shape and placements", "DTensor: each its shard"),
        ("gefen/records/{opt}/{r}", "int64 [1 + P, 7]: row 0 = global step, P; row 1 + i = parameter i's "
         "start, length, period, step, vmean_step, first block, number of blocks", "rank r"),
        ("gefen/blocks/{opt}/{r}", "fp32 [blocks, 2]: magnitude, vmean, all parameters of the optimizer "
         "back to back", "rank r"),
        ("gefen/codebook/{opt}/{r}", "fp32 [256], sorted, ends -1 and +1", "rank r"),
    ],
}

RECORD_FIELDS = ("start", "length", "period", "step", "vmean_step", "block0", "nblocks")  # v1 records


def _key(version: int, index: int, **names: object) -> str:
    return KEYS[version][index][0].format(**names)


def format_key() -> str:
    return _key(2, 0)


def optimizer_key(opt: str) -> str:
    return _key(2, 1, opt=opt)


def codebook_key_v2(opt: str) -> str:
    return _key(2, 2, opt=opt)


def codes_key(fqn: str) -> str:
    return _key(2, 3, fqn=fqn)


def magnitude_key(fqn: str) -> str:
    return _key(2, 4, fqn=fqn)


def vmean_key(fqn: str) -> str:
    return _key(2, 5, fqn=fqn)


def records_key(opt: str, label: int) -> str:
    return _key(1, 3, opt=opt, r=label)


def blocks_key(opt: str, label: int) -> str:
    return _key(1, 4, opt=opt, r=label)


def codebook_key(opt: str, label: int) -> str:
    return _key(1, 5, opt=opt, r=label)


def key_table(version: int) -> str:
    """The markdown key table of a version, as ``docs/checkpoint_format.md`` shows it."""
    rows = ["| key | value | written by |", "|---|---|---|"]
    rows += [f"| `{key}` | {value} | {by} |" for key, value, by in KEYS[version]]
    return "\n".join(rows)


def grid_shape(shape: tuple[int, ...], period: int) -> tuple[int, ...]:
    """Shape of a parameter's per-block tensors (magnitude, ``vmean``).

    Blocks run along the last dimension, so the block grid is the parameter's
    shape with the last dimension divided by the period; it shards with the
    parameter's own placements.
    """
    if not shape:
        return ()
    if shape[-1] % period:
        raise ValueError(f"period {period} does not divide the last dimension of shape {tuple(shape)}")
    return tuple(shape[:-1]) + (shape[-1] // period,)
