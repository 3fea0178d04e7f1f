"""Per-rank blocking (checkpoint format v1): each rank's state after a load against the state at the save.

Under format v1 each rank keeps its own picture of the state (a kind that
runs per-rank blocking: its own codebook and periods), so a load at another
layout re-blocks and requantizes. What a kind promises there, and within
which bounds, is the kind's own: its registry entry's ``validation``
(``optim.kind_validation``: ``compare_rank`` and ``rank_tolerances``; Gefen's
in ``optim.kinds.gefen.validation``). Here is what is generic:
parameters and torch's optimizers' state, resharded element-wise by DCP,
must be exact everywhere. The inputs are the per-rank dumps of
``gefen_titan.validation.hooks``. This module names no kind.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gefen_titan.optim import registry
from gefen_titan.optim.kind_validation import DENSE_FIGURES

__all__ = ["compare_state", "tolerances"]


def tolerances() -> dict[str, float]:
    """The bound of every figure of the registered kinds' per-rank comparisons (``rank_tolerances``)."""
    out: dict[str, float] = {}
    for spec in registry.specs():
        if spec.validation is not None:
            out.update(spec.validation.rank_tolerances)
    return out


def _flat(dumps: list[dict], key: str, fqn: str) -> tuple[Any, list[tuple[int, int]]]:
    recs = [d[key][fqn] for d in dumps if fqn in d[key]]
    numel = math.prod(recs[0]["shape"])
    full = torch.zeros(numel)
    for rec in recs:
        if rec["length"]:
            full[rec["start"]:rec["start"] + rec["length"]] = rec["local"]
    return full, [(r["start"], r["length"]) for r in recs]


def _kinds(ref_dumps: list[dict], res_dumps: list[dict]) -> tuple[dict[str, Any], list[str], bool]:
    """Every kind's own per-rank comparison: (figures, problems, whether all are exact)."""
    figures: dict[str, Any] = dict.fromkeys(DENSE_FIGURES.values(), 0.0)
    problems: list[str] = []
    exact = True
    read = set()
    for spec in registry.specs():
        if spec.validation is None or spec.validation.compare_rank is None:
            continue
        ref = [d["kinds"].get(spec.name) for d in ref_dumps]
        res = [d["kinds"].get(spec.name) for d in res_dumps]
        if all(x is None for x in ref + res):
            continue
        read.add(spec.name)
        out = dict(spec.validation.compare_rank(ref, res))
        problems += out.pop("problems")
        exact = exact and out.pop("exact")
        figures.update(out)  # each kind's figures; one kind runs per-rank blocking today
    unread = sorted({name for d in ref_dumps + res_dumps for name in d["kinds"]} - read)
    if unread:
        problems.append(f"the dumps hold per-rank state of {', '.join(unread)}, which no registered kind reads")
    return figures, problems, exact


def compare_state(ref_dumps: list[dict], res_dumps: list[dict]) -> dict[str, Any]:
    """Per-rank blocking (format v1): the resumed run's state right after the
    load against the reference's state at the save, from per-rank dumps."""
    problems: list[str] = []
    # Parameters: DCP reshards them element-wise, so bit-exact.
    param_mismatch = []
    for fqn in ref_dumps[0]["params"]:
        a, _ = _flat(ref_dumps, "params", fqn)
        b, _ = _flat(res_dumps, "params", fqn)
        if not torch.equal(a, b):
            param_mismatch.append(fqn)
    if param_mismatch:
        problems.append(f"parameters differ after load ({len(param_mismatch)}: {', '.join(param_mismatch[:3])})")
    figures, kind_problems, kinds_exact = _kinds(ref_dumps, res_dumps)
    problems += kind_problems

    # Torch's optimizers (AdamW groups): their state, resharded element-wise.
    other_mismatch = []
    for fqn, rec in ref_dumps[0]["other_optim"].items():
        for key, value in rec.items():
            if key in ("shape", "start", "length"):
                continue
            if isinstance(value, float):
                same = all(d["other_optim"].get(fqn, {}).get(key) == value for d in res_dumps)
            else:
                full_ref = _flat_key(ref_dumps, fqn, key)
                full_res = _flat_key(res_dumps, fqn, key)
                same = full_res is not None and torch.equal(full_ref, full_res)
            if not same:
                other_mismatch.append(f"{fqn}.{key}")
    if other_mismatch:
        problems.append(f"the state of the other optimizers differs after load ({', '.join(other_mismatch[:3])})")
    return {
        "blocking": "per_rank",
        "exact": not problems and kinds_exact,
        "params_exact": not param_mismatch,
        **figures,
        "problems": problems,
    }


def _flat_key(dumps: list[dict], fqn: str, key: str):
    recs = [d["other_optim"][fqn] for d in dumps if fqn in d["other_optim"]]
    if not recs or any(key not in r for r in recs if r["length"]):
        return None
    full = torch.zeros(math.prod(recs[0]["shape"]))
    for r in recs:
        if r["length"]:
            full[r["start"]:r["start"] + r["length"]] = r[key]
    return full
