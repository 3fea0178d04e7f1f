"""The lines under validate's table, and the tolerances in its report: how each figure was judged.

``summary_lines``: the backend, the data order, how the loss tolerance was
measured, what the state comparison promised and (global order) the
parameters at the end; ``tolerances``: the same as ``report.json`` records
them. Split from ``command`` (which runs, judges and writes).
"""

from __future__ import annotations

from typing import Any

from gefen_titan.validation import params
from gefen_titan.validation.bands import LOG_RESOLUTION, LOSS_FLOOR, LOSS_K
from gefen_titan.validation.layouts import Side
from gefen_titan.validation.report import TOLERANCES, PairResult
from gefen_titan.validation.runs import Run

__all__ = ["summary_lines", "tolerances"]


def tolerances(used: list[str], global_batch: int | None) -> dict[str, Any]:
    loss = (f"N->N max({LOG_RESOLUTION}, {LOSS_K} * rerun deviation); N->M max({LOG_RESOLUTION}, "
            f"{LOSS_K} * max(rerun, reduction-order deviation))" if global_batch
            else f"max({LOSS_FLOOR}, {LOSS_K} * sigma)")
    out = {**{b: TOLERANCES[b] for b in used if b in TOLERANCES}, "loss": loss}
    if global_batch:
        out["final_params"] = (f"per figure ({', '.join(params.FIGURES)}): N->N {LOSS_K} * rerun deviation; "
                               f"N->M {LOSS_K} * max(rerun, reduction-order deviation of the references)")
    return out


def _ranks(key: int | str | None) -> str:
    return f"{key} rank(s)" if isinstance(key, int) else str(key)


def _param_lines(results: list[PairResult], pband: dict[str, Any], refs: str) -> list[str]:
    """Global order: each pair's parameters at step S+K against the
    uninterrupted run at its target side, and how the tolerance was measured."""
    lines = [f"parameters at step {pband['step']}, resumed vs uninterrupted at the target side "
             "(relative L2 / max |diff|):"]
    for r in results:
        f = r.final_params
        figures = "exact" if f["exact"] else f"{f['rel_l2']:.1e} / {f['max_abs']:.1e}"
        lines.append(f"  {r.pair}: {figures}  (tolerance {f['tolerance']['rel_l2']:.1e} / "
                     f"{f['tolerance']['max_abs']:.1e}; {f['entries_differ']} of {f['entries']} entries differ)")
    rr, ro = pband["rerun_deviation"], pband["reduction_order_deviation"]
    between = pband["reduction_order_between"]["rel_l2"]
    lines.append(f"tolerance: N->N {LOSS_K:g} x the same-size rerun's deviation ({rr['rel_l2']:.1e} / "
                 f"{rr['max_abs']:.1e} at {_ranks(pband['rerun_size'])}); N->M {LOSS_K:g} x max(that, the "
                 f"references at {refs} ranks' largest deviation ({ro['rel_l2']:.1e} / {ro['max_abs']:.1e}"
                 + (f", {between[0]} vs {between[1]}" if between else "")
                 + "): same batches, other gradient reduction order)")
    return lines


def summary_lines(results: list[PairResult], band: dict[str, Any], used: list[str], references: dict[Side, Run],
             global_batch: int | None, backend_note: str, pband: dict[str, Any] | None = None) -> list[str]:
    """The lines under the table: the backend, the data order, how the loss
    tolerance was measured, what the state comparison promised, and (global
    order) the parameters at the end."""
    sides = sorted(references, key=Side.sort_key)
    refs = ", ".join(s.label for s in sides)
    every = "every size" if all(s.plain for s in sides) else "every size and layout"
    lines = [f"\nbackend: {backend_note}"]
    if global_batch:
        lines.append(f"data order: global (the same {global_batch} samples in global batch b at {every}); "
                     "every resumed run read the uninterrupted run's batches" if all(r.batches_equal for r in results)
                     else f"data order: global ({global_batch} samples a step); BATCHES DIFFER (see below)")
        lines.append("loss deviation per step, |resumed - uninterrupted at the source size|:")
        lines += [f"  {r.pair}: " + ", ".join(f"step {t} {d:.1e}" for t, d in sorted(r.step_deviations.items()))
                  + f"  (tolerance {r.loss_band:.1e})" for r in results]
        lines.append(f"tolerance: N->N {band['band_same_size']:.1e} = max({LOG_RESOLUTION:g}, {LOSS_K:g} x the "
                     f"same-size rerun's deviation {band['rerun_deviation']:.1e} at {_ranks(band['rerun_size'])}); "
                     f"N->M {band['band']:.1e} = max({LOG_RESOLUTION:g}, {LOSS_K:g} x max(that, the references at "
                     f"{refs} ranks' deviation {band['reduction_order_deviation']:.1e}: same batches, other "
                     "gradient reduction order))")
        if pband is not None:
            lines += _param_lines(results, pband, refs)
    else:
        lines.append(f"loss band (N->M): {band['band']:.4f} = max({LOSS_FLOOR}, {LOSS_K:g} x sigma), "
                     f"sigma {band['sigma']:.4f} = max("
                     f"RMS difference between the references at {refs} ranks {band['sigma_between_references']:.4f}, "
                     f"their second-difference noise {band['sigma_second_difference']:.4f}); N->N: exact")
    for b in used:
        if b == "agreed":
            lines.append("state after load (agreed blocking, checkpoint format v3): bit-exact for every pair: every "
                         "checkpoint entry and parameter gathered to global tensors, and every rank's periods, "
                         "codebook, counters and hyperparameters, equal to the save's")
        elif b == "per_rank":
            bounds = ", ".join(f"{k.removesuffix('_rel_l2').replace('_', ' ')} <= {v:g}"
                               for k, v in TOLERANCES["per_rank"].items())
            lines.append(f"state after load (per-rank blocking, format v1; relative L2 where not bit-exact): "
                         f"{bounds}; parameters and step counters exact")
    return lines
