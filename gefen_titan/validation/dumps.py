"""The state dumps of ``gefen_titan.validation.hooks``, read back.

A load or save is dumped either per rank (per-rank blocking, format v1:
``<kind>-<step>-rank<r>.pt``, one per rank) or as the global state (agreed
blocking, format v3: ``<kind>-<step>-global-rank<r>.pt``, one per writer);
``dumps_blocking`` tells them apart and the other functions answer for both.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["dumps_blocking", "dumps_complete", "dumps_params", "dumps_seconds", "merge_global"]


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
