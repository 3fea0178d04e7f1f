"""The state dumps of ``gefen_titan.validation.hooks``, read back, and the figures both comparisons share.

A load or save is dumped either per rank (per-rank blocking, format v1:
``<kind>-<step>-rank<r>.pt``, one per rank) or as the global state (agreed
blocking, format v3: ``<kind>-<step>-global-rank<r>.pt``, one per writer);
``dumps_blocking`` tells them apart and the other functions answer for both.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["dumps_blocking", "dumps_complete", "dumps_params", "dumps_seconds", "first_update", "merge_global",
           "rel_l2"]


def merge_global(dumps: list[dict]) -> dict[str, Any]:
    """One global picture from the writers' dumps of one load or save."""
    world = dumps[0]["world"]
    params: dict[str, Any] = {}
    state: dict[str, Any] = {}
    covered: set[int] = set()
    for d in dumps:
        params.update(d["params"])
        state.update(d["state"])
        covered.update(d["covers"])
    return {"world": world, "params": params, "state": state, "live": dumps[0]["live"],
            "complete": covered == set(range(world)), "seconds": max(dumps[0]["seconds"], default=float("nan"))}


def dumps_blocking(dumps: list[dict]) -> str:
    return dumps[0].get("blocking", "per_rank") if dumps else ""


def dumps_complete(dumps: list[dict], nproc: int) -> bool:
    if not dumps:
        return False
    if dumps_blocking(dumps) == "agreed":
        return dumps[0]["world"] == nproc and merge_global(dumps)["complete"]
    return len(dumps) == nproc


def dumps_seconds(dumps: list[dict]) -> float:
    if not dumps:
        return float("nan")
    if dumps_blocking(dumps) == "agreed":
        return max(dumps[0]["seconds"], default=float("nan"))
    return max(d["seconds"] for d in dumps)


def dumps_params(dumps: list[dict]) -> int | None:
    """Parameter count of the model from a save's dumps."""
    if not dumps:
        return None
    if dumps_blocking(dumps) == "agreed":
        return sum(t.numel() for t in merge_global(dumps)["params"].values())
    return sum(math.prod(rec["shape"]) for rec in dumps[0]["params"].values())


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|; where b is 0, 1 if a differs and 0 if not."""
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm() > 0)


def first_update(m: torch.Tensor, v: torch.Tensor, hyper: dict[str, float], vstep: int) -> torch.Tensor:
    """The update of a zero new gradient: m' = b1 m, v' = b2 v, one more step
    for the bias correction; the constant b1 / bc1 cancels in relative errors."""
    bc2 = 1 - hyper["beta2"] ** vstep
    return m / ((hyper["beta2"] * v / bc2).clamp_min(0).sqrt() + hyper["eps"])
