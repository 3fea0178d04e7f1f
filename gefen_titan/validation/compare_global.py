"""Agreed blocking (checkpoint format v3): the global state after a load against the global state at the save.

Format v3 (as v2) makes the whole state a function of the model alone, and DCP
reshards it with no requantization (``docs/checkpoint_format.md``), so the
comparison has no tolerance: everything must be bit-exact, for splits and
merges alike. The inputs are the global dumps of
``gefen_titan.validation.hooks`` (``dumps.merge_global`` joins the writers').
Record JSON and entry keys are read only through
``gefen_titan.checkpoint.schema``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gefen_titan.checkpoint import schema, schema_records
from gefen_titan.validation.dumps import first_update, merge_global, rel_l2

__all__ = ["compare_global_state"]

def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return a == b


def _records(state: dict[str, Any]) -> dict[str, tuple[str, schema_records.ParamRecord]]:
    """fqn -> (optimizer id, the saved v2/v3 record of a Gefen parameter)."""
    out = {}
    for key, value in state.items():
        parsed = schema.parse_key(key)
        if parsed is not None and parsed.kind == "optimizer":
            for p in schema_records.OptimizerRecord.from_json(value, parsed.name).params:
                out[p.fqn] = (parsed.name, p)
    return out


def _record_difference(a: str, b: str, opt: str) -> str:
    """The first field in which two records of an optimizer differ."""
    try:
        ra, rb = schema_records.OptimizerRecord.from_json(a, opt), schema_records.OptimizerRecord.from_json(b, opt)
    except schema.FormatError as e:
        return str(e)
    for key in ("blocking", "deterministic", "global_step"):
        if getattr(ra, key) != getattr(rb, key):
            return f"{key} {getattr(rb, key)} != saved {getattr(ra, key)}"
    pa = {p.fqn: p.to_dict() for p in ra.params}
    pb = {p.fqn: p.to_dict() for p in rb.params}
    for fqn in pa:
        if fqn not in pb:
            return f"{fqn} missing"
        for key in sorted(set(pa[fqn]) | set(pb[fqn])):
            if pa[fqn].get(key) != pb[fqn].get(key):
                return f"{fqn} {key} {pb[fqn].get(key)} != saved {pa[fqn].get(key)}"
    return "parameter order"


def _dense(state: dict[str, Any], fqn: str, period: int, codebook):
    """Dense momentum and per-element vmean of one parameter from v3 or v2
    entries (Gefen's dequantization: codebook[codes] * magnitude), or None."""
    version = schema.VERSION if schema.grid_key(fqn) in state else schema.V2
    keys = schema.param_tensor_keys(fqn, version)
    tensors = {name: state.get(key) for name, key in keys.items()}
    if any(t is None for t in tensors.values()) or codebook is None:
        return None
    codes = tensors["codes"]
    mag, vmean = schema.unpack_blocks(version, tensors)
    m = codebook.float().index_select(0, codes.reshape(-1).long()).reshape(codes.shape)
    if codes.dim():
        m = m * mag.float().repeat_interleave(period, dim=-1)
        v = vmean.float().repeat_interleave(period, dim=-1)
    else:
        m, v = m * mag.float(), vmean.float()
    return m.reshape(-1), v.reshape(-1)


def _param_differences(ref: dict[str, Any], res: dict[str, Any]) -> list[str]:
    """The parameters (gathered) not equal in dtype and value, and the extra ones."""
    differ = [fqn for fqn, t in ref["params"].items() if not _same(t, res["params"].get(fqn))]
    return differ + [fqn for fqn in res["params"] if fqn not in ref["params"]]


def _entry_differences(rs: dict[str, Any], ss: dict[str, Any]) -> list[str]:
    """Every checkpoint entry not equal after the load, missing or extra; a
    record names its first differing field."""
    differ: list[str] = []
    for key, value in rs.items():
        if key not in ss:
            differ.append(f"{key} (missing)")
        elif not _same(value, ss[key]):
            parsed = schema.parse_key(key)
            if parsed is not None and parsed.kind == "optimizer":
                differ.append(f"{key} ({_record_difference(value, ss[key], parsed.name)})")
            else:
                differ.append(key)
    return differ + [f"{key} (extra)" for key in ss if key not in rs]


def _live_problems(ref_live: list[dict], res_live: list[dict]) -> list[str]:
    """The live facts on every rank of the resumed run against the saved
    job's: periods and counters, hyperparameters, codebooks, global steps."""
    saved_params: dict[str, dict] = {}
    saved_opts: dict[str, dict] = {}
    for live in ref_live:
        for fqn, rec in live["params"].items():
            saved_params.setdefault(fqn, rec)
        for opt_id, rec in live["optimizers"].items():
            if opt_id not in saved_opts or saved_opts[opt_id]["codebook"] is None:
                saved_opts[opt_id] = rec
    counters, lrs, books, gsteps = [], [], [], []
    for rank, live in enumerate(res_live):
        for fqn, rec in live["params"].items():
            want = saved_params.get(fqn)
            if want is None:
                continue
            got = (rec["period"], rec["step"], rec["vmean_step"])
            saved = (want["period"], want["step"], want["vmean_step"])
            if got != saved:
                counters.append(f"{fqn} on rank {rank}: {got} != saved {saved}")
            if rec["hyper"] != want["hyper"]:
                lrs.append(f"{fqn} on rank {rank}: lr {rec['hyper']['lr']:g} != saved {want['hyper']['lr']:g}"
                           if rec["hyper"]["lr"] != want["hyper"]["lr"] else f"{fqn} on rank {rank}: {rec['hyper']}")
        for opt_id, rec in live["optimizers"].items():
            want = saved_opts.get(opt_id)
            if want is None:
                continue
            holds = any(p["has_state"] for p in live["params"].values() if p["optimizer"] == opt_id)
            cb = rec["codebook"]
            if (cb is None and holds) or (cb is not None and not _same(want["codebook"], cb)):
                books.append(f"{opt_id} on rank {rank}")
            if rec["global_step"] != want["global_step"]:
                gsteps.append(f"{opt_id} on rank {rank}: {rec['global_step']} != saved {want['global_step']}")
    problems = []
    if counters:
        problems.append(f"step counters (period, step, vmean_step) differ after the load in {len(counters)} "
                        f"(parameter, rank) pairs, e.g. {counters[0]}")
    if lrs:
        problems.append(f"learning rate or other hyperparameters differ after the load in {len(lrs)} "
                        f"(parameter, rank) pairs, e.g. {lrs[0]}")
    if books:
        problems.append(f"the live codebook differs from the saved one ({len(books)}: {', '.join(books[:3])})")
    if gsteps:
        problems.append(f"global step differs after the load ({len(gsteps)}, e.g. {gsteps[0]})")
    return problems


def _dense_errors(rs: dict[str, Any], ss: dict[str, Any]) -> dict[str, Any]:
    """Momentum, ``vmean`` and first-update relative L2 errors over the saved
    Gefen parameters with state (0 where exact), and how many elements have
    no state after the load."""
    num = {"m": 0.0, "v": 0.0, "u": 0.0}
    den = {"m": 0.0, "v": 0.0, "u": 0.0}
    worst_update, total, missing = 0.0, 0, 0
    for fqn, (opt_id, rec) in _records(rs).items():
        period = rec.period
        if not period:
            continue
        saved = _dense(rs, fqn, period, rs.get(schema.codebook_key(opt_id)))
        if saved is None:
            continue
        m_ref, v_ref = saved
        total += m_ref.numel()
        loaded = _dense(ss, fqn, period, ss.get(schema.codebook_key(opt_id)))
        if loaded is None:
            missing += m_ref.numel()
            m_res, v_res = torch.zeros_like(m_ref), torch.zeros_like(v_ref)
        else:
            m_res, v_res = loaded
        vstep = rec.vmean_step + 1
        u_ref = first_update(m_ref, v_ref, rec.group, vstep)
        u_res = first_update(m_res, v_res, rec.group, vstep)
        for key, (a, b) in {"m": (m_res, m_ref), "v": (v_res, v_ref), "u": (u_res, u_ref)}.items():
            num[key] += float((a - b).double().square().sum())
            den[key] += float(b.double().square().sum())
        worst_update = max(worst_update, rel_l2(u_res, u_ref))
    rel = {k: math.sqrt(num[k] / den[k]) if den[k] > 0 else 0.0 for k in num}
    return {"rel": rel, "worst_update": worst_update, "total": total, "missing": missing}


def compare_global_state(ref_dumps: list[dict], res_dumps: list[dict]) -> dict[str, Any]:
    """Agreed blocking (format v3): the global state right after the load
    against the global state at the save. Everything must be bit-exact.

    * every parameter (gathered) equal in dtype and value;
    * every entry of the optimizer container's ``state_dict()`` (Gefen codes,
      magnitudes, ``vmean``, records and codebook; other optimizers' flat
      state), gathered, equal; none missing, none extra;
    * on every rank of the resumed run, the live facts equal the saved job's:
      each Gefen parameter's period, step, ``vmean_step`` and
      hyperparameters, each Gefen optimizer's codebook (on every rank that
      holds state) and global step.

    The momentum, ``vmean`` and first-update errors are computed as for
    per-rank blocking (and are 0 when the state is exact).
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
    gefen_differ = [d for d in differ if schema.is_gefen_key(d)]
    other_differ = [d for d in differ if not schema.is_gefen_key(d)]
    problems += _live_problems(ref["live"], res["live"])
    dense = _dense_errors(rs, ss)
    if dense["missing"]:
        problems.append(f"{dense['missing']} of {dense['total']} Gefen elements have no optimizer state after the load")
    if gefen_differ:
        problems.append(f"Gefen state after the load is not bit-exact (format v3 promises it): {len(gefen_differ)} "
                        f"of {sum(schema.is_gefen_key(k) for k in rs)} checkpoint entries differ, e.g. "
                        f"{', '.join(gefen_differ[:3])}")
    if other_differ:
        problems.append(f"non-Gefen optimizer state differs after load ({', '.join(other_differ[:3])})")
    return {
        "blocking": "agreed",
        "exact": not problems,
        "params_exact": not param_mismatch,
        "momentum_rel_l2": dense["rel"]["m"],
        "vmean_rel_l2": dense["rel"]["v"],
        "first_update_rel_l2": dense["rel"]["u"],
        "first_update_worst_param": dense["worst_update"],
        "entries": len(rs),
        "entries_differ": differ,
        "gefen_elements": dense["total"],
        "problems": problems,
    }
