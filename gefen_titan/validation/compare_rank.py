"""Per-rank blocking (checkpoint format v1): each rank's state after a load against the state at the save.

Under format v1 each rank has its own codebook and periods, so a load at
another layout re-blocks and requantizes. The v1 adapter
(``gefen_titan.optim.checkpointing.gefen_per_rank``) promises a bit-exact state where a
target shard lies on whole blocks of one source rank whose codebook it
adopts, and its own error bounds elsewhere
(``TOL_MOMENTUM``, ``TOL_VMEAN``, ``TOL_UPDATE``). Parameters, step counters,
learning rates and other optimizers' state must be exact everywhere. The
inputs are the per-rank dumps of ``gefen_titan.validation.hooks``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gefen_titan.validation.dumps import first_update, rel_l2

__all__ = ["TOL_MOMENTUM", "TOL_UPDATE", "TOL_VMEAN", "compare_state", "dense_gefen"]

# The v1 adapter's own bounds where it does not promise bit-exactness
# (tests/integration/test_reshard.py): one requantization of the momentum
# against a merged codebook, block means of vmean.
TOL_MOMENTUM = 2e-2  # relative L2 of the dequantized momentum
TOL_VMEAN = 5e-2  # relative L2 of the per-element second moment
TOL_UPDATE = 3e-2  # relative L2 of the first update direction


def _flat(dumps: list[dict], key: str, fqn: str) -> tuple[Any, list[tuple[int, int]]]:
    recs = [d[key][fqn] for d in dumps if fqn in d[key]]
    numel = math.prod(recs[0]["shape"])
    full = torch.zeros(numel)
    for rec in recs:
        if rec["length"]:
            full[rec["start"]:rec["start"] + rec["length"]] = rec["local"]
    return full, [(r["start"], r["length"]) for r in recs]


def dense_gefen(dumps: list[dict]) -> dict[str, dict]:
    """Per Gefen parameter: dense momentum m and per-element vmean v over the
    whole parameter, the counters, and each rank's (start, length, period)."""
    out: dict[str, dict] = {}
    for rank, d in enumerate(dumps):
        for fqn, rec in d["gefen"].items():
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
            cb = d["codebooks"][rec["optimizer"]]["codebook"]
            p = rec["period"]
            sl = slice(rec["start"], rec["start"] + rec["length"])
            # Gefen's own dequantization: codebook.index_select(codes) * magnitude.
            e["m"][sl] = cb.index_select(0, rec["codes"].long()) * rec["magnitude"].repeat_interleave(p)
            e["v"][sl] = rec["vmean"].repeat_interleave(p)
            e["steps"].add(rec["step"])
            e["vsteps"].add(rec["vmean_step"])
            e["global_steps"].add(d["codebooks"][rec["optimizer"]]["global_step"])
            e["regions"].append((rank, rec["start"], rec["length"], p, rec["optimizer"]))
    return out


def _promised_exact(ref: dict[str, dict], res: dict[str, dict], res_dumps: list[dict]) -> dict[str, list[slice]]:
    """Element ranges where the v1 adapter promises a bit-exact state.

    A target rank adopts a source rank's codebook when all of its elements
    of that optimizer come from that one source; then each of its shards that
    lies on whole blocks of that source keeps codes, magnitudes and vmean.
    """
    promised: dict[str, list[slice]] = {}
    for rank in range(len(res_dumps)):
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

    ref, res = dense_gefen(ref_dumps), dense_gefen(res_dumps)
    if set(ref) != set(res):
        problems.append("the Gefen parameter sets differ")
    promised = _promised_exact(ref, res, res_dumps)
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

    # Other optimizers (AdamW groups): torch state, resharded element-wise.
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
        problems.append(f"non-Gefen optimizer state differs after load ({', '.join(other_mismatch[:3])})")

    rel = {k: math.sqrt(num[k] / den[k]) if den[k] > 0 else 0.0 for k in num}
    fraction = exact_elems / total if total else 0.0
    return {
        "blocking": "per_rank",
        "exact": not problems and fraction == 1.0 and rel["m"] == rel["v"] == rel["u"] == 0.0,
        "params_exact": not param_mismatch,
        "momentum_rel_l2": rel["m"],
        "vmean_rel_l2": rel["v"],
        "first_update_rel_l2": rel["u"],
        "first_update_worst_param": worst_update,
        "exact_promised_fraction": fraction,
        "exact_held": not exact_broken,
        "gefen_elements": total,
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

