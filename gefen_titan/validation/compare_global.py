"""Agreed blocking (checkpoint format v3): the global state after a load against the global state at the save.

Format v3 (as v2) makes the whole state a function of the model alone, and DCP
reshards it with no requantization (``docs/checkpoint_format.md``), so the
comparison has no tolerance: everything must be bit-exact, for splits and
merges alike. The inputs are the global dumps of
``gefen_titan.validation.hooks`` (``dumps.merge_global`` joins the writers').
Entry keys are read only through ``gefen_titan.checkpoint.format.schema``, and an
entry's kind through the kinds' checkpoint descriptions
(``checkpoint.format.kinds``); what only a kind knows (its live facts, its dense
state) it answers through its registry entry's ``validation``
(``optim.kind_validation``). This module names no kind.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from gefen_titan.checkpoint.format import kinds, schema
from gefen_titan.optim import registry
from gefen_titan.optim.kind_validation import DENSE_FIGURES, rel_l2
from gefen_titan.validation.dumps import merge_global

__all__ = ["compare_global_state"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return a == b


def _owner(key: str) -> str | None:
    """The kind whose checkpoint description claims the entry's key kind, None for torch's flat state."""
    parsed = schema.parse_key(key)
    if parsed is None:
        return None
    return next((d.name for d in kinds.descriptions() if parsed.kind in d.key_kinds), None)


def _first_difference(saved: Any, got: Any, where: str = "") -> str | None:
    """The first place two parsed JSON records differ (a list of objects with an ``fqn`` is named by it)."""
    if isinstance(saved, dict) and isinstance(got, dict):
        for key in sorted(set(saved) | set(got), key=str):
            if key not in got or key not in saved:
                return f"{where}{key} {'missing' if key not in got else 'extra'}"
            if (d := _first_difference(saved[key], got[key], f"{where}{key} ")) is not None:
                return d
        return None
    if isinstance(saved, list) and isinstance(got, list) and len(saved) == len(got):
        for i, (a, b) in enumerate(zip(saved, got)):
            name = a.get("fqn", i) if isinstance(a, dict) else i
            if (d := _first_difference(a, b, f"{where}{name} ")) is not None:
                return d
        return None
    if isinstance(saved, list) and isinstance(got, list):
        return f"{where}{len(got)} items != saved {len(saved)}"
    return None if saved == got else f"{where}{got} != saved {saved}".strip()


def _record_difference(saved: Any, got: Any) -> str:
    """What differs in a kind's record (its JSON), named."""
    try:
        return _first_difference(json.loads(saved), json.loads(got)) or "the same JSON, another text"
    except (TypeError, ValueError):
        return "not a JSON record"


def _param_differences(ref: dict[str, Any], res: dict[str, Any]) -> list[str]:
    """The parameters (gathered) not equal in dtype and value, and the extra ones."""
    differ = [fqn for fqn, t in ref["params"].items() if not _same(t, res["params"].get(fqn))]
    return differ + [fqn for fqn in res["params"] if fqn not in ref["params"]]


def _entry_differences(rs: dict[str, Any], ss: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, what) of every checkpoint entry not equal after the load, missing or extra; a kind's
    record names its first differing field."""
    differ: list[tuple[str, str]] = []
    for key, value in rs.items():
        if key not in ss:
            differ.append((key, f"{key} (missing)"))
        elif not _same(value, ss[key]):
            if _owner(key) is not None and not isinstance(value, torch.Tensor):
                differ.append((key, f"{key} ({_record_difference(value, ss[key])})"))
            else:
                differ.append((key, key))
    return differ + [(key, f"{key} (extra)") for key in ss if key not in rs]


def _validated() -> list[tuple[str, Any]]:
    """(name, validation) of every registered kind with a ``validation``, in registry order."""
    return [(s.name, s.validation) for s in registry.specs() if s.validation is not None]


def _live_problems(ref_live: list[dict], res_live: list[dict]) -> list[str]:
    """Each kind's live facts on every rank of the resumed run against the saved job's (its
    ``validation.live_problems``); facts of a kind no entry reads are a problem themselves."""
    problems = []
    for name, validation in _validated():
        ref, res = [live.get(name) for live in ref_live], [live.get(name) for live in res_live]
        if any(x is not None for x in ref + res):
            problems += validation.live_problems(ref, res)
    known = {name for name, _ in _validated()}
    unread = sorted({name for live in ref_live + res_live for name in live} - known)
    if unread:
        problems.append(f"the dumps hold live facts of {', '.join(unread)}, which no registered kind reads")
    return problems


def _dense_errors(rs: dict[str, Any], ss: dict[str, Any]) -> dict[str, Any]:
    """Each kind's dense state (its ``validation.dense``) after the load against the save: relative L2 of
    ``DENSE_FIGURES`` over the saved parameters with state (0 where exact), the worst parameter's first
    update, and per kind how many elements have no state after the load."""
    num = dict.fromkeys(DENSE_FIGURES, 0.0)
    den = dict.fromkeys(DENSE_FIGURES, 0.0)
    worst_update, total, missing = 0.0, 0, {}
    for name, validation in _validated():
        if validation.dense is None:
            continue
        saved, loaded = validation.dense(rs), validation.dense(ss)
        for fqn, ref in saved.items():
            total += ref["m"].numel()
            res = loaded.get(fqn)
            if res is None:
                missing[name] = missing.get(name, 0) + ref["m"].numel()
                res = {k: torch.zeros_like(t) for k, t in ref.items()}
            for key in DENSE_FIGURES:
                num[key] += float((res[key] - ref[key]).double().square().sum())
                den[key] += float(ref[key].double().square().sum())
            worst_update = max(worst_update, rel_l2(res["u"], ref["u"]))
    rel = {DENSE_FIGURES[k]: math.sqrt(num[k] / den[k]) if den[k] > 0 else 0.0 for k in num}
    return {"rel": rel, "worst_update": worst_update, "total": total, "missing": missing}


def compare_global_state(ref_dumps: list[dict], res_dumps: list[dict]) -> dict[str, Any]:
    """Agreed blocking (format v3): the global state right after the load
    against the global state at the save. Everything must be bit-exact.

    * every parameter (gathered) equal in dtype and value;
    * every entry of the optimizer container's ``state_dict()`` (each kind's
      tensors, records and codebooks; torch's optimizers' flat state),
      gathered, equal; none missing, none extra;
    * on every rank of the resumed run, each kind's live facts equal the
      saved job's (Gefen: each parameter's period, step, ``vmean_step`` and
      hyperparameters, each optimizer's codebook on every rank that holds
      state, and global step).

    The momentum, second-moment and first-update errors of each kind's dense
    state are computed as for per-rank blocking (and are 0 when the state is exact).
    """
    ref, res = merge_global(ref_dumps), merge_global(res_dumps)
    problems: list[str] = []
    if not ref["complete"] or not res["complete"]:
        problems.append("the global dumps do not cover every rank")
    param_mismatch = _param_differences(ref, res)
    if param_mismatch:
        problems.append(f"parameters differ after load ({len(param_mismatch)}: {', '.join(param_mismatch[:3])})")
    rs, ss = ref["state"], res["state"]
    differ = _entry_differences(rs, ss)
    problems += _live_problems(ref["live"], res["live"])
    dense = _dense_errors(rs, ss)
    for name, count in dense["missing"].items():
        problems.append(f"{count} of {dense['total']} elements of {name} parameters have no optimizer state after "
                        "the load")
    owners = {key: _owner(key) for key in set(rs) | set(ss)}
    for name in [d.name for d in kinds.descriptions()]:
        mine = [what for key, what in differ if owners[key] == name]
        if mine:
            problems.append(f"{name} state after the load is not bit-exact (agreed blocking promises it, "
                            f"format v3 and later): {len(mine)} of {sum(owners[k] == name for k in rs)} "
                            "checkpoint entries differ, e.g. "
                            f"{', '.join(mine[:3])}")
    shared = [what for key, what in differ if owners[key] is None and schema.parse_key(key) is not None]
    if shared:  # the format's own entries (the header), no kind's
        problems.append(f"the checkpoint format's shared entries differ after load ({', '.join(shared[:3])})")
    others = [what for key, what in differ if owners[key] is None and schema.parse_key(key) is None]
    if others:
        problems.append(f"the flat state of the other optimizers differs after load ({', '.join(others[:3])})")
    return {
        "blocking": "agreed",
        "exact": not problems,
        "params_exact": not param_mismatch,
        **dense["rel"],
        "first_update_worst_param": dense["worst_update"],
        "entries": len(rs),
        "entries_differ": [what for _, what in differ],
        "dense_elements": dense["total"],
        "problems": problems,
    }
