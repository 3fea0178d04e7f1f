"""The bad checkpoints the fail-closed tests try, edited from good ones.

Each case pairs a damage with the text the load's error must contain:

* ``V2_CASES`` (agreed blocking, format v3 as a run writes it: global grids
  per parameter, JSON records, one codebook per optimizer), tried by ``agreed_worker``'s
  ``--cases`` (tests/integration/test_agreed_blocking.py);
* ``MUON_CASES`` (GefenMuon's entries, and checkpoints of one optimizer
  kind loaded by the other), tried by ``muon_worker``'s ``--cases``
  (tests/integration/test_gefen_muon.py);
* ``V1_CASES`` (per-rank blocking, format v1: per-rank record tables and
  blocks), tried by ``reshard_worker``'s corrupt mode
  (tests/integration/test_reshard_fail_closed.py).

The writers run in the test process between launches: the sources are
saved by one launch, the copies tried by a later one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

from gefen_titan.checkpoint.io.storage import load_all

Edit = Callable[[dict], None]


def edited(src: Path, dst: Path, step: int, edit: Edit) -> None:
    """A copy of checkpoint root ``src`` (its ``ckpt/step-N``) at ``dst``, the
    optimizer's entries passed through ``edit``; the scratch file lies next to ``dst``."""
    full = dst.parent / (dst.name + ".pt")
    sd = load_all(src / "ckpt" / f"step-{step}")
    edit(sd["optimizer"])
    torch.save(sd, full)
    # DCP's own writer: the copy stores every entry framed and has no .digests (it loads unchecked).
    torch_save_to_dcp(str(full), str(dst / "ckpt" / f"step-{step}"))


def damaged_file(src: Path, dst: Path, step: int, damage: Callable[[Path], None]) -> None:
    """A copy of checkpoint root ``src`` with rank 1's data file passed through ``damage``."""
    shutil.copytree(src, dst)
    damage(dst / "ckpt" / f"step-{step}" / "__1_0.distcp")


def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:1000])


def set_entry(key: str, fn) -> Edit:
    def edit(opt):
        opt[key] = fn(opt[key])
    return edit


def drop_entry(key: str) -> Edit:
    return lambda opt: opt.pop(key)


# ------------------------------------------------------------------ format v3 (agreed)
def set_v2_record(fqn: str, field: str, value) -> Edit:
    """A field of ``fqn``'s JSON record."""
    def edit(opt):
        for key in [k for k in opt if k.startswith("gefen/optimizer/")]:
            rec = json.loads(opt[key])
            for p in rec["params"]:
                if p["fqn"] == fqn:
                    p[field] = value
            opt[key] = json.dumps(rec)
    return edit


def nudged(cb: torch.Tensor) -> torch.Tensor:
    """The codebook with one entry moved (still sorted, still in [-1, 1])."""
    cb = cb.clone()
    cb[100] = (cb[99] + cb[100]) / 2
    return cb


# name -> (source checkpoint, edit, "truncate" or None (the source as it is),
# config overrides of the loading optimizer, expected text)
V2_CASES = {
    "grid_missing": ("c_fsdp2", lambda o: o.pop("gefen/grid/layers.0.w1.weight"), "", "missing from the checkpoint"),
    "grid_corrupt": ("c_fsdp2", set_entry("gefen/grid/output.weight",
                                          lambda v: v.index_fill(-1, torch.tensor([0]), float("nan"))), "",
                     "non-finite"),
    "grid_shape": ("c_fsdp2", set_entry("gefen/grid/output.weight", lambda v: v[:, :1].clone()), "", "expected"),
    "counters": ("c_fsdp2", set_v2_record("layers.1.w2.weight", "vmean_step", 99), "", "counters do not add up"),
    "codebook_corrupt": ("c_fsdp2", set_entry("gefen/codebook/tok_embeddings.weight", lambda v: v.flip(0)), "",
                         "is corrupt"),
    "codebooks_disagree": ("c_pp2", set_entry("gefen/codebook/layers.1.norm.weight", nudged), "",
                           "codebooks disagree"),
    "deterministic": ("c_fsdp2", None, "|deterministic=1", "optimizer.deterministic"),
    "blocking": ("c_fsdp2", None, "|blocking=per_rank", 'optimizer.blocking.mode = "agreed"'),
    "v1_into_agreed": ("c_v1", None, "", 'optimizer.blocking.mode = "per_rank"'),
    "truncated": ("c_fsdp2", "truncate", "", "cannot read"),
}


def v2_case_path(base: Path, root: Path, name: str) -> str:
    """Case ``name`` as ``agreed_worker --cases`` takes it: CHECKPOINT[|key=value...]."""
    src, edit, overrides, _ = V2_CASES[name]
    return f"{base / src if edit is None else root / name}{overrides}"


def v2_case_key(name: str) -> str:
    """The key ``agreed_worker`` files case ``name``'s result under."""
    src, edit, overrides, _ = V2_CASES[name]
    return (src if edit is None else name) + overrides.replace("|", "")


def write_v2(base: Path, root: Path, step: int) -> None:
    """The edited checkpoints of V2_CASES under ``root``, from those saved in ``base``."""
    for name, (src, edit, _, _) in V2_CASES.items():
        if edit == "truncate":
            damaged_file(base / src, root / name, step, truncate)
        elif edit is not None:
            edited(base / src, root / name, step, edit)


# ------------------------------------------------------------------ GefenMuon
def set_muon_record(fqn: str, field: str, value, in_group: bool = False) -> Edit:
    """A field of ``fqn``'s GefenMuon record (of its group's keys with ``in_group``)."""
    def edit(opt):
        for key in [k for k in opt if k.startswith("gefen/muon/")]:
            rec = json.loads(opt[key])
            for p in rec["params"]:
                if p["fqn"] == fqn:
                    (p["group"] if in_group else p)[field] = value
            opt[key] = json.dumps(rec)
    return edit


def drop_prefix(prefix: str) -> Edit:
    def edit(opt):
        for key in [k for k in opt if k.startswith(prefix)]:
            opt.pop(key)
    return edit


# As V2_CASES; "c_fsdp2" is a GefenMuon + Gefen checkpoint, "c_gefen2" a
# Gefen-only one of the same model; "|gefen=1": the loading run gives every
# parameter to Gefen.
MUON_CASES = {
    "muon_rows_missing": ("c_fsdp2", drop_entry("gefen/muon_rows/layers.0.w1.weight"), "",
                          "missing from the checkpoint"),
    "muon_magnitude_nan": ("c_fsdp2", set_entry("gefen/muon_magnitude/layers.1.w2.weight",
                                                lambda v: v.fill_(float("nan"))), "", "non-finite"),
    "muon_codes_shape": ("c_fsdp2", set_entry("gefen/muon_codes/layers.0.w2.weight", lambda v: v[:, :8].clone()), "",
                         "expected"),
    "muon_shape": ("c_fsdp2", set_muon_record("gate.weight", "shape", [3, 64]), "", "another model"),
    "muon_counters": ("c_fsdp2", set_muon_record("layers.1.w1.weight", "rows_step", 99), "",
                      "counters do not add up"),
    "muon_hyper": ("c_fsdp2", set_muon_record("layers.0.w1.weight", "ns_steps", 0, in_group=True), "", "invalid"),
    "muon_codebook_missing": ("c_fsdp2", drop_prefix("gefen/muon_codebook/"), "", "no codebook"),
    "muon_truncated": ("c_fsdp2", "truncate", "", "cannot read"),
    "muon_into_gefen": ("c_fsdp2", None, "|gefen=1", "were saved by GefenMuon and the recipe gives them to Gefen"),
    "gefen_into_muon": ("c_gefen2", None, "", "were saved by Gefen and the recipe gives them to GefenMuon"),
}


def muon_case_path(base: Path, root: Path, name: str) -> str:
    src, edit, overrides, _ = MUON_CASES[name]
    return f"{base / src if edit is None else root / name}{overrides}"


def muon_case_key(name: str) -> str:
    src, edit, overrides, _ = MUON_CASES[name]
    return (src if edit is None else name) + overrides.replace("|", "")


def write_muon(base: Path, root: Path, step: int) -> None:
    """The edited checkpoints of MUON_CASES under ``root``, from those saved in ``base``."""
    for name, (src, edit, _, _) in MUON_CASES.items():
        if edit == "truncate":
            damaged_file(base / src, root / name, step, truncate)
        elif edit is not None:
            edited(base / src, root / name, step, edit)


# ------------------------------------------------------------------ format v1
def set_v1_hyper(fqn: str, name: str, value) -> Edit:
    def edit(opt):
        for key in [k for k in opt if k.startswith("gefen/optimizer/")]:
            meta = json.loads(opt[key])
            for rec in meta["params"]:
                if rec["fqn"] == fqn:
                    rec["group"][name] = value
            opt[key] = json.dumps(meta)
    return edit


def _v1_record(opt: dict, fqn: str) -> tuple[str, int]:
    """(records key of source rank 0's table, row of ``fqn``)."""
    for key in [k for k in opt if k.startswith("gefen/optimizer/")]:
        names = [rec["fqn"] for rec in json.loads(opt[key])["params"]]
        if fqn in names:
            return key.replace("gefen/optimizer/", "gefen/records/"), 1 + names.index(fqn)
    raise KeyError(fqn)


def set_v1_record(fqn: str, rank: int, column: int, fn) -> Edit:
    """A column of ``fqn``'s row in source rank ``rank``'s record table."""
    def edit(opt):
        key, row = _v1_record(opt, fqn)
        key = f"{key}/{rank}"
        opt[key][row, column] = fn(int(opt[key][row, column]))
    return edit


def nan_v1_blocks(fqn: str, rank: int) -> Edit:
    def edit(opt):
        key, row = _v1_record(opt, fqn)
        table = opt[f"{key}/{rank}"]
        b0, nb = int(table[row, 5]), int(table[row, 6])
        opt[f"{key}/{rank}".replace("/records/", "/blocks/")][b0 : b0 + nb] = float("nan")
    return edit


# name -> (damage, expected text): an edit of the optimizer's entries, or
# ("file", f) for a damage f of rank 1's data file. "adamw" (another
# optimizer's checkpoint of the same model) is saved by a worker job instead.
V1_CASES = {
    "format": (set_entry("gefen/format", lambda v: json.dumps({"format": "gefen-titan", "version": 99})), "v1"),
    "other_model": (drop_entry("gefen/codes/output.weight"), "no Gefen state for 1 live parameter"),
    "shape": (set_entry("gefen/codes/output.weight", lambda v: v[:256].clone()), "written for another model"),
    "nonfinite": (nan_v1_blocks("layers.0.w1.weight", 1), "non-finite"),
    "counters": (set_v1_record("layers.1.w2.weight", 0, 4, lambda v: 99), "counters do not add up"),
    "hyper": (set_v1_hyper("norm.weight", "beta1", 1.5), "cannot be represented"),
    "codebook": (set_entry("gefen/codebook/tok_embeddings.weight/0", lambda v: v.flip(0)),
                 "codebook of source rank 0"),
    "gap": (set_v1_record("layers.0.w2.weight", 1, 0, lambda v: v + 128), "do not tile"),
    "missing": (("file", Path.unlink), "cannot read"),
    "truncated": (("file", truncate), "cannot read"),
    "adamw": (None, "were saved by AdamW and the recipe gives them to Gefen"),
}


def write_v1(src: Path, root: Path, step: int) -> None:
    """The damaged copies of checkpoint root ``src`` for V1_CASES, under ``root``."""
    for name, (damage, _) in V1_CASES.items():
        if isinstance(damage, tuple):
            damaged_file(src, root / name, step, damage[1])
        elif damage is not None:
            edited(src, root / name, step, damage)
