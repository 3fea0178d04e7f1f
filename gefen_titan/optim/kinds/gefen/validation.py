"""Gefen's part of the reshard validation (``optim.kind_validation.KindValidation``, on its registry entry).

What only Gefen knows of its state, for ``gefen_titan.validation``:

* its live facts on a rank (agreed blocking): each parameter's period, step
  counters and hyperparameters, each optimizer's codebook and global step,
  read through ``optim.gefenx``; after a load every rank's must equal the
  saved job's (a rank that holds no state may have no codebook);
* its dense state from gathered v4/v3/v2 entries: its dequantization
  ``codebook[codes] * magnitude`` and the per-element ``vmean`` (a factored
  parameter's: its rows and columns rebuilt, ``factored.rebuilt``), and the
  first update of a zero gradient (Adam's form, which Gefen's step takes);
* under per-rank blocking (format v1, Gefen's alone): each rank's codes,
  magnitudes, ``vmean``, periods and counters, compared where the v1
  adapter (``gefen_per_rank``) promises a bit-exact state and within its
  own bounds (``TOL_MOMENTUM``, ``TOL_VMEAN``, ``TOL_UPDATE``) elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim import Optimizer

from gefen_titan.checkpoint.format import schema
from gefen_titan.distributed import local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.kind_validation import KindValidation, rel_l2
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.optim.kinds.gefen.factored import rebuilt
from gefen_titan.optim.kinds.gefen.keys import HYPER
from gefen_titan.optim.kinds.gefen.per_rank_regions import param_region

__all__ = ["TOL_MOMENTUM", "TOL_UPDATE", "TOL_VMEAN", "VALIDATION", "compare_rank", "dense", "first_update",
           "live_facts", "live_problems", "rank_state"]

# The v1 adapter's own bounds where it does not promise bit-exactness
# (tests/integration/test_reshard.py): one requantization of the momentum
# against a merged codebook, block means of vmean.
TOL_MOMENTUM = 2e-2  # relative L2 of the dequantized momentum
TOL_VMEAN = 5e-2  # relative L2 of the per-element second moment
TOL_UPDATE = 3e-2  # relative L2 of the first update direction


def _opt_id(optim: Optimizer) -> str:
    """An optimizer's name in the checkpoint (``schema.optimizer_id``)."""
    return schema.optimizer_id([name for name, _, _ in gx.named_params(optim)])


def _codebook(optim: Optimizer) -> dict[str, Any]:
    cb = gx.codebook(optim)
    return {"codebook": None if cb is None else cb.detach().float().cpu().clone(), "global_step": gx.global_step(optim)}


def first_update(m: torch.Tensor, v: torch.Tensor, hyper: dict[str, float], vstep: int) -> torch.Tensor:
    """The update of a zero new gradient: m' = b1 m, v' = b2 v, one more step
    for the bias correction; the constant b1 / bc1 cancels in relative errors."""
    bc2 = 1 - hyper["beta2"] ** vstep
    return m / ((hyper["beta2"] * v / bc2).clamp_min(0).sqrt() + hyper["eps"])


# ------------------------------------------------------------------ agreed blocking
def live_facts(optimizers: list[Optimizer]) -> dict[str, Any]:
    """This rank's live facts: per parameter its period, counters and hyperparameters; per optimizer its
    codebook and global step."""
    params: dict[str, dict[str, Any]] = {}
    opts: dict[str, dict[str, Any]] = {}
    for optim in optimizers:
        opt_id = _opt_id(optim)
        opts[opt_id] = _codebook(optim)
        for fqn, p, group in gx.named_params(optim):
            st = gx.gefen_read(optim, p)
            if st is not None:
                period, step, vstep, has_state = st.period, st.step, st.vmean_step, True
            else:  # never stepped, or an empty local shard (counters kept by gefen_titan)
                period = gx.period(optim, p) or 0
                step, vstep = gx.gefen_empty_shard_counters(optim, p)
                has_state = False
            params[fqn] = {"optimizer": opt_id, "period": int(period), "step": int(step), "vmean_step": int(vstep),
                           "has_state": has_state, "local_numel": local(p).numel(),
                           "hyper": {k: float(group[k]) for k in HYPER}}
    return {"params": params, "optimizers": opts}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return a == b


def live_problems(ref_live: list[Any], res_live: list[Any]) -> list[str]:
    """The live facts on every rank of the resumed run against the saved job's: periods and counters,
    hyperparameters, codebooks (on every rank that holds state), global steps."""
    empty = {"params": {}, "optimizers": {}}
    saved_params: dict[str, dict] = {}
    saved_opts: dict[str, dict] = {}
    for live in (x or empty for x in ref_live):
        for fqn, rec in live["params"].items():
            saved_params.setdefault(fqn, rec)
        for opt_id, rec in live["optimizers"].items():
            if opt_id not in saved_opts or saved_opts[opt_id]["codebook"] is None:
                saved_opts[opt_id] = rec
    counters, lrs, books, gsteps = [], [], [], []
    for rank, live in enumerate(x or empty for x in res_live):
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


def dense(entries: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter with state: dense momentum ``m`` (``codebook[codes] * magnitude``), per-element
    ``vmean`` ``v`` and first update ``u``, from gathered v3 or v2 entries (records read through the schema).
    A parameter whose record does not parse or does not fit its tensors is left out (no state: the
    validation reports it, and the differing entries)."""
    out = {}
    for key, value in entries.items():
        parsed = schema.parse_key(key)
        if parsed is None or parsed.kind != "gefen":
            continue
        codebook = entries.get(gefen_keys.codebook_key(parsed.name))
        try:
            records = gefen_records.OptimizerRecord.from_json(value, parsed.name).params
        except schema.FormatError:
            continue
        for rec in records:
            # A factored record is v4's whether or not its tensors are there (a parameter without state yet
            # has none: e.g. after a resume that dropped the optimizer).
            version = schema.VERSION if rec.factored or gefen_keys.grid_key(rec.fqn) in entries else schema.V2
            try:
                keys = gefen_keys.param_tensor_keys(rec.fqn, version, rec.factored)
            except schema.FormatError:
                continue
            tensors = {name: entries.get(k) for name, k in keys.items()}
            if not rec.period or codebook is None or any(t is None for t in tensors.values()):
                continue
            codes = tensors["codes"]
            try:
                mag, vmean = gefen_keys.unpack_blocks(version, tensors)
            except schema.FormatError:
                continue
            if codes.dim() and (mag.shape[-1] * rec.period != codes.shape[-1]
                                or (vmean is not None and mag.shape != vmean.shape)):
                continue
            m = codebook.float().index_select(0, codes.reshape(-1).long()).reshape(codes.shape)
            if rec.factored:  # the second moment the step rebuilds from the rows and columns
                m = m * mag.float().repeat_interleave(rec.period, dim=-1)
                v = rebuilt(tensors["vrow"], tensors["vcol"], tuple(codes.shape))
            elif codes.dim():
                m = m * mag.float().repeat_interleave(rec.period, dim=-1)
                v = vmean.float().repeat_interleave(rec.period, dim=-1)
            else:
                m, v = m * mag.float(), vmean.float()
            m, v = m.reshape(-1), v.reshape(-1)
            out[rec.fqn] = {"m": m, "v": v, "u": first_update(m, v, rec.group, rec.vmean_step + 1)}
    return out


# ------------------------------------------------------------------ per-rank blocking (format v1)
def rank_state(optimizers: list[Optimizer]) -> dict[str, Any]:
    """This rank's picture: every parameter's state as the optimizer holds it, where its local shard lies
    in the flattened parameter, and each optimizer's codebook and global step."""
    params, opts = {}, {}
    for optim in optimizers:
        opt_id = _opt_id(optim)
        opts[opt_id] = _codebook(optim)
        for fqn, p, group in gx.named_params(optim):
            region, _ = param_region(fqn, p)
            rec: dict[str, Any] = {"shape": tuple(p.shape), "start": region.start, "length": region.length,
                                   "optimizer": opt_id,
                                   "hyper": {k: float(group[k]) for k in ("lr", "beta1", "beta2", "eps")}}
            st = gx.gefen_read(optim, p)
            if st is not None:
                rec.update(period=st.period, step=st.step, vmean_step=st.vmean_step,
                           codes=st.codes.reshape(-1).cpu().clone(),
                           magnitude=st.magnitude.reshape(-1).float().cpu().clone(),
                           vmean=st.vmean.reshape(-1).float().cpu().clone())
            params[fqn] = rec
    return {"params": params, "optimizers": opts}


def _dense_ranks(ranks: list[Any]) -> dict[str, dict]:
    """Per parameter: dense momentum m and per-element vmean v over the whole parameter, the counters,
    and each rank's (rank, start, length, period, optimizer)."""
    out: dict[str, dict] = {}
    for rank, d in enumerate(ranks):
        for fqn, rec in (d or {"params": {}})["params"].items():
            numel = math.prod(rec["shape"])
            e = out.setdefault(fqn, {"m": torch.zeros(numel), "v": torch.zeros(numel), "missing": 0,
                                     "steps": set(), "vsteps": set(), "regions": [], "hyper": rec["hyper"],
                                     "global_steps": set(), "lrs": set()})
            if not rec["length"]:
                continue
            e["lrs"].add(rec["hyper"]["lr"])
            if "codes" not in rec:
                e["missing"] += rec["length"]
                e["regions"].append((rank, rec["start"], rec["length"], 0, rec["optimizer"]))
                continue
            book = d["optimizers"][rec["optimizer"]]
            p = rec["period"]
            sl = slice(rec["start"], rec["start"] + rec["length"])
            e["m"][sl] = book["codebook"].index_select(0, rec["codes"].long()) * rec["magnitude"].repeat_interleave(p)
            e["v"][sl] = rec["vmean"].repeat_interleave(p)
            e["steps"].add(rec["step"])
            e["vsteps"].add(rec["vmean_step"])
            e["global_steps"].add(book["global_step"])
            e["regions"].append((rank, rec["start"], rec["length"], p, rec["optimizer"]))
    return out


def _promised_exact(ref: dict[str, dict], res: dict[str, dict], ranks: int) -> dict[str, list[slice]]:
    """Element ranges where the v1 adapter promises a bit-exact state.

    A target rank adopts a source rank's codebook when all of its elements
    of that optimizer come from that one source; then each of its shards that
    lies on whole blocks of that source keeps codes, magnitudes and vmean.
    """
    promised: dict[str, list[slice]] = {}
    for rank in range(ranks):
        by_opt: dict[str, set] = {}
        mine = []
        for fqn, e in res.items():
            for r, start, length, _, opt in e["regions"]:
                if r != rank or not length:
                    continue
                srcs = [s for s in ref[fqn]["regions"] if s[3] and s[1] < start + length and start < s[1] + s[2]]
                by_opt.setdefault(opt, set()).update(s[0] for s in srcs)
                mine.append((fqn, start, length, opt, srcs))
        for fqn, start, length, opt, srcs in mine:
            if len(by_opt[opt]) != 1 or len(srcs) != 1:
                continue
            _, s_start, s_len, period, _ = srcs[0]
            if s_start <= start and start + length <= s_start + s_len and (start - s_start) % period == 0 \
                    and (start + length - s_start) % period == 0:
                promised.setdefault(fqn, []).append(slice(start, start + length))
    return promised


def compare_rank(ref_ranks: list[Any], res_ranks: list[Any]) -> dict[str, Any]:
    """The resumed ranks' state right after the load against the saved ranks' at the save."""
    ref, res = _dense_ranks(ref_ranks), _dense_ranks(res_ranks)
    problems = ["the Gefen parameter sets differ"] if set(ref) != set(res) else []
    promised = _promised_exact(ref, res, len(res_ranks))
    num = {"m": 0.0, "v": 0.0, "u": 0.0}
    den = {"m": 0.0, "v": 0.0, "u": 0.0}
    worst_update, exact_elems, exact_broken, total, missing = 0.0, 0, [], 0, 0
    counters: list[str] = []
    lrs: list[str] = []
    for fqn, r in ref.items():
        s = res.get(fqn)
        if s is None:
            continue
        total += r["m"].numel()
        missing += s["missing"]
        if s["steps"] != r["steps"] or s["vsteps"] != r["vsteps"] or s["global_steps"] != r["global_steps"]:
            counters.append(f"{fqn}: {sorted(s['steps'])}/{sorted(s['vsteps'])}/{sorted(s['global_steps'])} "
                            f"!= saved {sorted(r['steps'])}/{sorted(r['vsteps'])}/{sorted(r['global_steps'])}")
        if s["lrs"] != r["lrs"]:
            lrs.append(f"{fqn}: {sorted(s['lrs'])} != saved {sorted(r['lrs'])}")
        for sl in promised.get(fqn, []):
            exact_elems += sl.stop - sl.start
            if not (torch.equal(s["m"][sl], r["m"][sl]) and torch.equal(s["v"][sl], r["v"][sl])):
                exact_broken.append(fqn)
        h = r["hyper"]
        vstep = max(r["vsteps"] or {0}) + 1
        u_ref = first_update(r["m"], r["v"], h, vstep)
        u_res = first_update(s["m"], s["v"], h, vstep)
        for key, (a, b) in {"m": (s["m"], r["m"]), "v": (s["v"], r["v"]), "u": (u_res, u_ref)}.items():
            num[key] += float((a - b).double().square().sum())
            den[key] += float(b.double().square().sum())
        worst_update = max(worst_update, rel_l2(u_res, u_ref))
    if missing:
        problems.append(f"{missing} of {total} Gefen elements have no optimizer state after the load")
    if counters:
        problems.append(f"step counters (step/vmean_step/global_step) differ after the load for {len(counters)} "
                        f"of {len(ref)} Gefen parameters, e.g. {counters[0]}")
    if lrs:
        problems.append(f"learning rate differs after the load for {len(lrs)} of {len(ref)} Gefen parameters, "
                        f"e.g. {lrs[0]}")
    if exact_broken:
        problems.append("state not bit-exact where the adapter promises it "
                        f"({', '.join(sorted(set(exact_broken))[:3])})")
    rel = {k: math.sqrt(num[k] / den[k]) if den[k] > 0 else 0.0 for k in num}
    fraction = exact_elems / total if total else 0.0
    return {
        "exact": fraction == 1.0 and rel["m"] == rel["v"] == rel["u"] == 0.0,
        "momentum_rel_l2": rel["m"],
        "vmean_rel_l2": rel["v"],
        "first_update_rel_l2": rel["u"],
        "first_update_worst_param": worst_update,
        "exact_promised_fraction": fraction,
        "exact_held": not exact_broken,
        "dense_elements": total,
        "problems": problems,
    }


VALIDATION = KindValidation(
    live_facts=live_facts,
    live_problems=live_problems,
    dense=dense,
    rank_state=rank_state,
    compare_rank=compare_rank,
    rank_tolerances={"momentum_rel_l2": TOL_MOMENTUM, "vmean_rel_l2": TOL_VMEAN, "first_update_rel_l2": TOL_UPDATE},
)
