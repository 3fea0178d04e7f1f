"""``ckpt convert --to gefen``: AdamW's moments to Gefen state (``convert``'s doc says the mapping).

The periods by agreed blocking's rule on ``exp_avg_sq``, one codebook from the
histogram of block-normalized ``exp_avg``, the momentum requantized with Gefen's
rule, and the second moment as the row and column means of ``exp_avg_sq``
(a matrix, ``--second-moment factored``, the default) or its block mean. Apart from ``convert``
because that module holds the other direction and the command's frame.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
from torchtitan.components.checkpoint import OPTIMIZER

from gefen_titan.checkpoint.format import schema, schema_records
from gefen_titan.checkpoint.format.schema import grid_shape
from gefen_titan.ckpt_tools.convert_options import ConvertOptions
from gefen_titan.ckpt_tools.saved_records import codebook_summary
from gefen_titan.ckpt_tools.view import Checkpoint, CkptError, split_state_key
from gefen_titan.optim.block_periods import candidate_periods, period_from_sums, row_unit
from gefen_titan.optim.block_stats import HIST_BINS, block_variance_sums, histogram
from gefen_titan.optim.codebook_solver import codebook_from_counts
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.optim.kinds.gefen.factored import rebuilt
from gefen_titan.optim.kinds.gefen.keys import HYPER
from gefen_titan.optim.quant.requant import block_mean, dequantize, expand_blocks, requantize

__all__ = ["to_gefen"]

_ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")


def _factors(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row means, column means) of a second moment of two dims or more: what ``--second-moment factored``
    keeps (``keys.factor_shapes``)."""
    v = v.double()
    return v.mean(dim=-1).float(), v.mean(dim=-2).float()


def _fixed_period_one(fqn: str, shape: tuple[int, ...], options: ConvertOptions) -> bool:
    # As AgreedBlocking._fixed_one (force_1d_period_one is always on under agreed blocking).
    return len(shape) <= 1 or math.prod(shape) == 1 or any(s in fqn.lower() for s in options.period_one_substrings)


def _choose_period(fqn: str, shape: tuple[int, ...], exp_avg_sq: torch.Tensor, options: ConvertOptions) -> int:
    if _fixed_period_one(fqn, shape, options):
        return 1
    unit = row_unit(fqn, torch.empty(shape, device="meta"), options.max_tensor_parallel_degree)
    candidates = candidate_periods(unit)
    # Gefen scores the within-block variance of grad²; exp_avg_sq is the
    # running mean of grad², so its square root stands in for the gradient.
    sums = block_variance_sums(exp_avg_sq.sqrt(), candidates, unit)
    return period_from_sums(candidates, sums, math.prod(shape), unit)


def _gefen_group(fqn: str, group: dict[str, Any]) -> dict[str, float]:
    if group.get("amsgrad"):
        raise CkptError(f"{fqn}: amsgrad = True keeps a running max of the second moment, which Gefen has not; "
                        "only plain Adam/AdamW state converts")
    if group.get("maximize"):
        raise CkptError(f"{fqn}: maximize = True has no Gefen equivalent")
    betas = group.get("betas") or (None, None)
    out = {"lr": group.get("lr"), "beta1": betas[0], "beta2": betas[1], "eps": group.get("eps"),
           "weight_decay": group.get("weight_decay")}
    if out["weight_decay"] and group.get("decoupled_weight_decay") is False:
        raise CkptError(f"{fqn}: Adam's coupled (L2) weight decay {out['weight_decay']} differs from Gefen's "
                        "decoupled one; only AdamW, or Adam with weight_decay 0, converts")
    try:
        gefen_records.check_hyper(fqn, out)
    except schema.FormatError as e:
        raise CkptError(str(e)) from e
    return {k: float(out[k]) for k in HYPER}


def to_gefen(ck: Checkpoint, options: ConvertOptions):
    """The entries that replace an AdamW checkpoint's optimizer state, the report, and the replaced keys."""
    if schema.header_key() in ck.optimizer:
        raise CkptError(f"{ck.path} already holds Gefen state ({schema.header_key()}): nothing to convert to Gefen")
    opt = ck.optimizer
    states: dict[str, dict[str, Any]] = {}
    for name, e in opt.items():
        split = split_state_key(name)
        if split:
            states.setdefault(split[0], {})[split[1]] = e
    if not states:
        raise CkptError(f"{ck.path} holds no optimizer state (a model-only checkpoint?): nothing to convert")
    for fqn, st in states.items():
        if tuple(sorted(st)) != _ADAM_STATE:
            raise CkptError(f"{fqn}: optimizer state {sorted(st)} is not Adam's {list(_ADAM_STATE)}; only "
                            "Adam/AdamW state converts to Gefen")
        if st["exp_avg"].shape != st["exp_avg_sq"].shape:
            raise CkptError(f"{fqn}: exp_avg and exp_avg_sq differ in shape: run `gefen-titan ckpt verify`")
    group_names = [n for fqn in states for n in (f"param_groups.{fqn}.{k}" for k in _GROUP_KEYS) if n in opt]
    small = ck.load_names(OPTIMIZER, group_names + [f"state.{fqn}.step" for fqn in states])
    groups, steps = {}, {}
    for fqn in states:
        groups[fqn] = _gefen_group(fqn, {k: small.get(f"param_groups.{fqn}.{k}") for k in _GROUP_KEYS})
        step = float(small[f"state.{fqn}.step"])
        if not (step >= 0 and step == int(step)):
            raise CkptError(f"{fqn}: AdamW step {step} is not a count")
        steps[fqn] = int(step)
    if len({s == 0 for s in steps.values()}) > 1:
        raise CkptError("some parameters have AdamW step 0 and others not: Gefen's agreed state is all or none")
    if options.second_moment not in ("block", "factored"):
        raise CkptError(f"--second-moment {options.second_moment!r}: expected block or factored")

    def moments(fqn):
        vals = ck.load_names(OPTIMIZER, [f"state.{fqn}.exp_avg", f"state.{fqn}.exp_avg_sq"])
        m, v = vals[f"state.{fqn}.exp_avg"].float(), vals[f"state.{fqn}.exp_avg_sq"].float()
        if not (torch.isfinite(m).all() and torch.isfinite(v).all()) or (v < 0).any():
            raise CkptError(f"{fqn}: non-finite exp_avg or negative/non-finite exp_avg_sq: the checkpoint is "
                            "corrupt; run `gefen-titan ckpt verify` on it")
        return m, v

    # Pass 1: periods and the job's histogram; pass 2 re-reads each
    # parameter's moments, so only one parameter's are in memory at a time.
    stepped = any(steps.values())
    periods, counts = {}, torch.zeros(HIST_BINS, dtype=torch.int64)
    for fqn in states if stepped else ():
        m, v = moments(fqn)
        shape = tuple(m.shape)
        periods[fqn] = _choose_period(fqn, shape, v, options)
        counts += histogram(m, periods[fqn])
    codebook = codebook_from_counts(counts) if stepped else None
    entries: dict[str, Any] = {}
    params, err_m, norm_m, err_v, norm_v = [], 0.0, 0.0, 0.0, 0.0
    for fqn in states:
        shape = tuple(states[fqn]["exp_avg"].shape)
        period = periods.get(fqn, 0)
        factored = options.second_moment == "factored" and len(shape) >= 2
        params.append(gefen_records.ParamRecord(fqn, shape, period, steps[fqn], steps[fqn], groups[fqn], factored))
        if not period:
            continue
        m, v = moments(fqn)
        codes, mag = requantize(m.reshape(-1), codebook, period)
        grid = grid_shape(shape, period)
        keys = gefen_keys.param_tensor_keys(fqn, factored=factored)
        entries[keys["codes"]] = codes.reshape(shape)
        if factored:
            v_row, v_col = _factors(v)
            entries[keys["grid"]] = gefen_keys.pack_blocks(mag.reshape(grid), None)
            entries[keys["vrow"]], entries[keys["vcol"]] = v_row, v_col
            back_v = rebuilt(v_row, v_col, shape).reshape(-1)
        else:
            vmean = block_mean(v.reshape(-1), period)
            entries[keys["grid"]] = gefen_keys.pack_blocks(mag.reshape(grid), vmean.reshape(grid))
            back_v = expand_blocks(vmean.reshape(-1), period, 0, m.numel())
        back_m = dequantize(codes.reshape(-1), codebook, mag.reshape(-1), period)
        err_m += float((back_m.double() - m.reshape(-1).double()).square().sum())
        norm_m += float(m.double().square().sum())
        err_v += float((back_v.double() - v.reshape(-1).double()).square().sum())
        norm_v += float(v.double().square().sum())
    opt_id = schema.optimizer_id(list(states))  # the one optimizer's first parameter, as a save names it
    record = gefen_records.OptimizerRecord(bool(options.deterministic), max(steps.values()), params)
    entries[schema.header_key()] = schema_records.Header.for_blocking("agreed").to_json()
    entries[gefen_keys.optimizer_key(opt_id)] = record.to_json()
    if codebook is not None:
        entries[gefen_keys.codebook_key(opt_id)] = codebook.float().clone()
    replaced = {opt[n].key for n in opt if split_state_key(n) and split_state_key(n)[0] in states}
    replaced |= {opt[n].key for n in opt if n.startswith("param_groups.") and
                 n[len("param_groups."):].rpartition(".")[0] in states}
    elements = sum(math.prod(p.shape) for p in params)
    state_bytes = sum(t.numel() * t.element_size() for t in entries.values() if isinstance(t, torch.Tensor))
    report = {
        "params": len(params),
        "elements": elements,
        "periods": {str(k): v for k, v in sorted(Counter(p.period for p in params).items())},
        "steps": {str(k): v for k, v in sorted(Counter(steps.values()).items())},
        "codebook": codebook_summary(codebook) if codebook is not None else None,
        "state_bytes_per_param": state_bytes / elements if elements else None,
        "momentum_relative_rms_error": math.sqrt(err_m / norm_m) if norm_m else 0.0,
        "second_moment_relative_rms_error": math.sqrt(err_v / norm_v) if norm_v else 0.0,
        "max_tensor_parallel_degree": options.max_tensor_parallel_degree,
        "deterministic": bool(options.deterministic),
        "second_moment": options.second_moment,
        "written": f"Gefen format v{schema.VERSION} (agreed blocking)",
        "resume": "--optimizer.name Gefen (agreed blocking, the default)"
                  + (f" with optimizer.blocking.max_tensor_parallel_degree = {options.max_tensor_parallel_degree}"
                     if options.max_tensor_parallel_degree > 1 else "")
                  + (" and optimizer.gefen.deterministic = true" if options.deterministic else "")
                  + (" and optimizer.gefen.second_moment = \"block\"" if options.second_moment == "block"
                     else ""),
        "notes": [],
    }
    return entries, report, replaced
