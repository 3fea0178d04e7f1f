"""Reading the worker's dumps: dense momentum / vmean from per-rank state."""

from __future__ import annotations

import glob
import os

import torch


def load_run(out_dir: str, mode: str, world: int) -> list[dict]:
    files = sorted(glob.glob(os.path.join(out_dir, f"{mode}_w{world}_r*.pt")),
                   key=lambda f: int(f.rsplit("_r", 1)[1][:-3]))
    assert len(files) == world, files
    return [torch.load(f, weights_only=False) for f in files]


def dense(ranks: list[dict], name: str, key: str = "state") -> tuple[torch.Tensor, torch.Tensor]:
    """Full dense (momentum, per-element vmean) of parameter ``name``."""
    recs = sorted((r[key][name] for r in ranks), key=lambda rec: rec["start"])
    numel = 1
    for d in recs[0]["shape"]:
        numel *= d
    m = torch.zeros(numel)
    v = torch.zeros(numel)
    for rec in recs:
        if rec["length"] == 0 or "codes" not in rec:
            continue
        codes, cb = rec["codes"].reshape(-1).long(), rec["codebook"]
        p = rec["period"]
        mag = rec["magnitude"].reshape(-1).repeat_interleave(p)
        m[rec["start"] : rec["start"] + rec["length"]] = cb[codes] * mag
        v[rec["start"] : rec["start"] + rec["length"]] = rec["vmean"].reshape(-1).repeat_interleave(p)
    return m, v


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def state_bytes_per_param(ranks: list[dict]) -> float:
    total, numel = 0, 0
    for rank in ranks:
        for rec in rank["state"].values():
            numel += rec["length"]
            if "codes" in rec:
                total += rec["codes"].numel() + 4 * rec["magnitude"].numel() + 4 * rec["vmean"].numel()
        total += 256 * 4  # one codebook per optimizer per rank
    return total / numel
