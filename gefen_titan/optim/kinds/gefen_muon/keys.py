"""GefenMuon's keys in the checkpoint format (v2 and v3, framed): its rows (``ROWS``), registered with its
description, and the functions that name its entries. A checkpoint without GefenMuon holds none of them."""

from __future__ import annotations

from gefen_titan.checkpoint.format.schema import KeyRow

__all__ = ["ROWS", "RECORD_KIND", "CODEBOOK_KIND", "TENSOR_KINDS", "KEY_DOCS", "MUON_TENSORS", "muon_optimizer_key",
           "muon_codebook_key", "muon_tensor_keys"]

_ROW = {r.kind: r for r in (
    KeyRow("muon", "gefen/muon/{opt}", small="str"),
    KeyRow("muon_codebook", "gefen/muon_codebook/{opt}", small="tensor"),
    KeyRow("muon_codes", "gefen/muon_codes/{fqn}"),
    KeyRow("muon_magnitude", "gefen/muon_magnitude/{fqn}"),
    KeyRow("muon_rows", "gefen/muon_rows/{fqn}"),
)}
ROWS: tuple[KeyRow, ...] = tuple(_ROW.values())
RECORD_KIND, CODEBOOK_KIND = "muon", "muon_codebook"
TENSOR_KINDS = frozenset(r.kind for r in ROWS if r.small is None)  # muon_codes, muon_magnitude, muon_rows

# A GefenMuon parameter's tensors ("rows" only with NorMuon state).
MUON_TENSORS = ("codes", "magnitude", "rows")


def muon_optimizer_key(opt: str) -> str:
    return _ROW["muon"].key(opt)


def muon_codebook_key(opt: str) -> str:
    """The job's GefenMuon codebook, under each GefenMuon optimizer's id."""
    return _ROW["muon_codebook"].key(opt)


def muon_tensor_keys(fqn: str) -> dict[str, str]:
    """A GefenMuon parameter's entries by ``MUON_TENSORS`` name."""
    return {name: _ROW["muon_" + name].key(fqn) for name in MUON_TENSORS}


# ``docs/checkpoint_format.md``'s rows of these keys (``KindDescription.key_docs``), the same in v2, v3 and v4.
_DOCS = (
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
)
KEY_DOCS: dict[int, tuple[tuple[str, str, str], ...]] = {4: _DOCS, 3: _DOCS, 2: _DOCS}
