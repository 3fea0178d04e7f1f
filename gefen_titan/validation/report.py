"""One pair's verdict and the validation's report: ``evaluate``, the table (the figures: ``figure``).

``evaluate`` checks a resumed run against its reference: the losses of
steps S+1..S+K within the pair's band, the batches read (global order), and
the state after the load (``compare_global.compare_global_state`` under
agreed blocking, ``compare_rank.compare_state`` under per-rank blocking)
within ``TOLERANCES``; with the global-order loader, also the parameters at
step S+K against the uninterrupted run at the target side
(``gefen_titan.validation.params``, passed in as ``final_params``). ``table``
shows the pairs (``figure.plot_pair`` draws each); the command
(``gefen_titan.validation.command``) writes them with ``report.json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gefen_titan.validation.compare_global import compare_global_state
from gefen_titan.validation.compare_rank import compare_state, tolerances
from gefen_titan.validation.dumps import dumps_blocking, dumps_complete, dumps_seconds
from gefen_titan.validation.runs import Run, Settings, checkpoint_bytes

__all__ = ["TOLERANCES", "PairResult", "compare_batches", "evaluate", "final_params_verdict", "state_verdict",
           "table"]

# The state figures' tolerances by blocking. Per-rank (format v1): the kinds'
# own bounds where they do not promise bit-exactness (compare_rank.tolerances). Agreed (format
# v2): none, every figure must be 0 and every entry equal.
TOLERANCES = {
    "per_rank": {"momentum_rel_l2": 0.0, "vmean_rel_l2": 0.0, "first_update_rel_l2": 0.0} | tolerances(),
    "agreed": {"momentum_rel_l2": 0.0, "vmean_rel_l2": 0.0, "first_update_rel_l2": 0.0},
}


@dataclass
class PairResult:
    pair: str
    source: int | str  # the side's key (layouts.Side.key): its process count, or its label ("2@ep2")
    target: int | str
    backend: str
    reference_losses: dict[int, float]
    resumed_losses: dict[int, float]
    loss_deviation: float
    loss_band: float
    state: dict[str, Any]
    checkpoint: dict[str, Any]
    save_seconds: float
    load_seconds: float
    failures: list[str]
    step_deviations: dict[int, float] = field(default_factory=dict)  # step -> |resumed - reference|
    data_order: str = "per_dp_size"  # or "global": the same global batches at every size
    batches_equal: bool | None = None  # global order: the resumed run read the reference's batches
    # Each side's degrees (layouts.DEGREES' names), as its runs trained.
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)
    # Global order: the parameters at step S+K against the uninterrupted run at
    # the target side (params.param_deviation), with "tolerance" per figure.
    final_params: dict[str, Any] | None = None
    # The same resume with the optimizer state dropped (step -> loss), where it was measured: what the
    # loss check would let through, drawn next to the real resume (figure.plot_pair).
    dropped_losses: dict[int, float] | None = None


def compare_batches(ref: Run, res: Run, global_batch: int, steps: range) -> list[str]:
    """Problems (none when equal) of the resumed run's global batches against
    the reference's, at the given steps."""
    want, got = ref.batches(global_batch), res.batches(global_batch)
    problems = []
    for t in steps:
        if t not in want or t not in got:
            problems.append(f"no batch record for step {t} ({'reference' if t not in want else 'resumed run'})")
        elif want[t] != got[t]:
            extra, lost = sorted(set(got[t]) - set(want[t])), sorted(set(want[t]) - set(got[t]))
            problems.append(f"step {t} read other samples than the uninterrupted run at {ref.side.ranks()} "
                            f"({len(extra)} not in it, e.g. {extra[:3]}; {len(lost)} missing, e.g. {lost[:3]})"
                            if extra or lost else f"step {t} read some samples twice")
    return problems


def evaluate(settings: Settings, ref: Run, res: Run, band: float, global_batch: int | None = None,
             final_params: tuple[dict[str, Any], list[str]] | None = None) -> PairResult:
    """One pair's verdict; ``final_params``: the parameter comparison's
    figures and failure lines (``params``), where it ran."""
    pair = f"{ref.side.label}->{res.side.label}"
    s = settings.steps_before
    window = range(s + 1, settings.total_steps + 1)
    failures = []
    missing_steps = [t for t in window if t not in res.losses or t not in ref.losses]
    if missing_steps:
        failures.append(f"{pair}: no loss logged for step(s) {missing_steps}")
    step_devs = {t: abs(res.losses[t] - ref.losses[t]) for t in window if t in res.losses and t in ref.losses}
    dev = max(step_devs.values()) if step_devs else float("inf")
    batches_equal = None
    if global_batch:
        batch_problems = compare_batches(ref, res, global_batch, window)
        batches_equal = not batch_problems
        failures += [f"{pair}: {p}" for p in batch_problems]
    if not all(math.isfinite(res.losses.get(t, float("nan"))) for t in window):
        failures.append(f"{pair}: non-finite loss after resume")
    if dev > band:
        failures.append(f"{pair}: max loss deviation {dev:.4f} > band {band:.4f}")

    ref_dumps, res_dumps = ref.dumps("save", s), res.dumps("load", s)
    blocking = dumps_blocking(ref_dumps) or dumps_blocking(res_dumps)
    if not (dumps_complete(ref_dumps, ref.nproc) and dumps_complete(res_dumps, res.nproc)) \
            or dumps_blocking(res_dumps) != blocking:
        failures.append(f"{pair}: state dumps missing or mismatched ({len(ref_dumps)} file(s) saved at {ref.nproc} "
                        f"rank(s), {len(res_dumps)} loaded at {res.nproc}; blocking "
                        f"{dumps_blocking(ref_dumps) or '?'} / {dumps_blocking(res_dumps) or '?'})")
        state: dict[str, Any] = {"blocking": blocking, "exact": False, "problems": ["no dumps"]}
    else:
        state = (compare_global_state if blocking == "agreed" else compare_state)(ref_dumps, res_dumps)
        failures += [f"{pair}: {p}" for p in state["problems"]]
        for key, what in (("momentum_rel_l2", "momentum error"), ("vmean_rel_l2", "second-moment error"),
                          ("first_update_rel_l2", "first-update error")):
            tol = TOLERANCES[blocking][key]
            if not state[key] <= tol:
                failures.append(f"{pair}: {what} {state[key]:.3g} > {tol:g}")
    if final_params is not None:
        failures += final_params[1]
    ckpt = checkpoint_bytes(Path(ref.folder, "checkpoint", f"step-{s}"))
    return PairResult(pair, ref.side.key, res.side.key, settings.backend, ref.losses, res.losses, dev, band,
                      state, ckpt, dumps_seconds(ref_dumps), dumps_seconds(res_dumps), failures, step_devs,
                      "global" if global_batch else "per_dp_size", batches_equal,
                      {"source": settings.degrees(ref.side), "target": settings.degrees(res.side)},
                      final_params[0] if final_params is not None else None)


def state_verdict(state: dict[str, Any]) -> str:
    """The table's ``state`` column: ``exact`` when the state after the load
    equals the saved state bit for bit."""
    if state.get("exact"):
        return "exact"
    if state.get("blocking") == "per_rank" and "exact_promised_fraction" in state:
        # v1: the share of the elements the adapter promises exact (the rest within bounds)
        return f"{100 * state['exact_promised_fraction']:.0f}% exact" + ("" if state.get("exact_held") else " BROKEN")
    return "DIFFER"


def _loss_figure(x: float) -> str:
    # Global-order tolerances sit at float rounding, far below 4 decimals.
    return f"{x:.4f}" if x == 0 or x >= 1e-3 else f"{x:.1e}"


def final_params_verdict(final: dict[str, Any]) -> str:
    """The table's ``end params`` column: ``exact``, or the relative L2 from the
    uninterrupted run at the target side (``FAR`` past its tolerance)."""
    if final["exact"]:
        return "exact"
    within = not final["problems"] and all(final[f] <= final["tolerance"][f] for f in ("rel_l2", "max_abs"))
    return f"{final['rel_l2']:.1e}" + ("" if within else " FAR")


def table(results: list[PairResult], n_params: int | None) -> str:
    # "end params" only where the parameter check ran (global order): the
    # table of the elastic loader is the same as before it existed.
    ends = any(r.final_params is not None for r in results)
    head = ("pair", "max|dloss|", "band", "momentum", "vmean", "1st update", "state", "params",
            *(("end params",) if ends else ()), "ckpt MB", "opt B/param", "save s", "load s", "verdict")
    rows = [head]
    for r in results:
        st = r.state
        opt_bpp = r.checkpoint["optimizer"] / n_params if n_params else float("nan")
        end = (final_params_verdict(r.final_params) if r.final_params is not None else "-",) if ends else ()
        rows.append((
            r.pair, _loss_figure(r.loss_deviation), _loss_figure(r.loss_band),
            f"{st.get('momentum_rel_l2', float('nan')):.2e}", f"{st.get('vmean_rel_l2', float('nan')):.2e}",
            f"{st.get('first_update_rel_l2', float('nan')):.2e}", state_verdict(st),
            "exact" if st.get("params_exact") else "DIFFER", *end,
            f"{r.checkpoint['total'] / 1e6:.1f}", f"{opt_bpp:.3f}",
            f"{r.save_seconds:.2f}", f"{r.load_seconds:.2f}", "FAIL" if r.failures else "ok",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
