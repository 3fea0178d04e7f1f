"""The loss tolerances of a reshard validation, measured on its own runs.

* elastic loader (torchtitan's per-rank document order): ``loss_band``, a
  data-order band from the references at every side of the pairs (and
  their second-difference noise); N->N resumes must match exactly.
* global-order loader: ``order_band``, from a same-size rerun's deviation
  (N->N) and from the references at the different sides (sizes and
  layouts: ``layouts.Side``), which read the same batches and differ only by
  the gradient reduction order (N->M).

``pair_loss_band`` picks one pair's tolerance from either. The references
are keyed by side; a bare process count stands for the side ``N``, and the
report names the sides as ``Side.key`` does (the count for a bare side).
"""

from __future__ import annotations

import math
from typing import Any

from gefen_titan.validation.layouts import Side, as_side
from gefen_titan.validation.runs import Run, Settings

__all__ = ["LOG_RESOLUTION", "LOSS_FLOOR", "LOSS_K", "loss_band", "order_band", "pair_loss_band",
           "second_difference_noise"]

# Loss: |resumed - reference| <= max(LOSS_FLOOR, LOSS_K * sigma), sigma the
# batch-to-batch noise of the loss measured on the reference curve(s); see
# loss_band() and docs/validation.md for the measurement.
LOSS_K = 3.0
LOSS_FLOOR = 0.02
# Global-order runs (order_band): the smallest tolerance, one unit of the 5
# decimals torchtitan logs the loss with.
LOG_RESOLUTION = 1e-5


def _second_differences(losses: dict[int, float], first: int, last: int | None) -> list[float]:
    steps = sorted(s for s in losses if s >= first and (last is None or s <= last))
    return [losses[a] - 2 * losses[b] + losses[c] for a, b, c in zip(steps, steps[1:], steps[2:]) if c - a == 2]


def second_difference_noise(losses: dict[int, float], first: int = 2, last: int | None = None) -> float:
    """Noise of the difference of two runs' losses at one step, from one curve.

    For a curve L[t] = trend + e[t] with independent batch noise e of std
    sigma, the second differences L[t-1] - 2 L[t] + L[t+1] have variance
    6 sigma^2, and two runs that read different batches differ by
    sqrt(2) sigma; so this returns RMS(second differences) / sqrt(3). The
    trend's curvature adds to it. Step 1 (before any update) is left out;
    ``first``/``last`` bound the steps used.
    """
    d2 = _second_differences(losses, first, last)
    return math.sqrt(sum(x * x for x in d2) / len(d2) / 3) if d2 else 0.0


def _keys(references: dict[Side | int, Run]) -> list[int | str]:
    return [s.key for s in sorted((as_side(k) for k in references), key=Side.sort_key)]


def loss_band(references: dict[Side | int, Run], settings: Settings) -> dict[str, Any]:
    """The loss tolerance of the pairs N->M with N != M, measured.

    The resumed run starts from the reference's exact state at step S but then
    reads other batches (the elastic loader splits the unread documents among
    M ranks), so it follows another trajectory: its loss differs from the
    reference's by what two runs that read the documents in another order
    differ by. The references at the pairs' sides (targets included) are
    such runs: same recipe, seed, global batch and LR schedule, another
    document order. So sigma is
    (a) the RMS over steps S+1..S+K and over every two references of their
    loss difference, or, where larger (or with one reference only),
    (b) the second-difference noise (``second_difference_noise``) pooled over
    the references, on steps max(2, S-K)..S+K (earlier steps are the start-up
    transient, whose curvature is not noise);
    band = max(LOSS_FLOOR, LOSS_K * sigma).
    """
    first = max(2, settings.steps_before - settings.steps_after)
    d2 = [x for r in references.values() for x in _second_differences(r.losses, first, settings.total_steps)]
    noise = math.sqrt(sum(x * x for x in d2) / len(d2) / 3) if d2 else 0.0
    window = range(settings.steps_before + 1, settings.total_steps + 1)
    runs = list(references.values())
    diffs = [a.losses[t] - b.losses[t] for i, a in enumerate(runs) for b in runs[i + 1:]
             for t in window if t in a.losses and t in b.losses]
    between = math.sqrt(sum(d * d for d in diffs) / len(diffs)) if diffs else 0.0
    sigma = max(noise, between)
    return {"sigma_between_references": between, "sigma_second_difference": noise,
            "sigma": sigma, "band": max(LOSS_FLOOR, LOSS_K * sigma),
            "references": _keys(references)}


def order_band(references: dict[Side | int, Run], rerun: Run | None, settings: Settings) -> dict[str, Any]:
    """The loss tolerances when every run reads the same global batches.

    With the global-order loader the resumed run at M reads, from the resume
    on, exactly the reference's batches from the reference's exact state
    (format v3), so nothing but the arithmetic can make its losses differ:

    * N->N: the same arithmetic. The tolerance is LOSS_K x the largest
      deviation of a same-size rerun (a second uninterrupted run at the
      first source size) from its reference over all steps: 0 where runs
      are deterministic (CPU), the run-to-run noise where they are not.
    * N->M: the gradients of the same samples are summed in another order
      (M ranks of other microbatch counts, another layout's collectives).
      The references at the different sides read the same batches too, so
      their largest deviation over
      steps S+1..S+K measures exactly that effect (from step 1 on: an upper
      bound for a resume, whose runs part only at step S). The tolerance is
      LOSS_K x the larger of the two.

    Both are at least ``LOG_RESOLUTION``: the logged losses have 5 decimals,
    so one rounding flip is 1e-5.
    """
    window = range(settings.steps_before + 1, settings.total_steps + 1)
    rerun_dev = 0.0
    if rerun is not None:
        ref = {as_side(k): v for k, v in references.items()}[rerun.side]
        rerun_dev = max((abs(rerun.losses[t] - ref.losses[t]) for t in ref.losses if t in rerun.losses), default=0.0)
    runs = list(references.values())
    reduction_dev = max((abs(a.losses[t] - b.losses[t]) for i, a in enumerate(runs) for b in runs[i + 1:]
                         for t in window if t in a.losses and t in b.losses), default=0.0)
    return {"order": "global", "rerun_size": rerun.side.key if rerun else None,
            "rerun_deviation": rerun_dev, "reduction_order_deviation": reduction_dev,
            "band_same_size": max(LOG_RESOLUTION, LOSS_K * rerun_dev),
            "band": max(LOG_RESOLUTION, LOSS_K * max(rerun_dev, reduction_dev)),
            "references": _keys(references)}


def pair_loss_band(source: Side | int, target: Side | int, band: dict[str, Any]) -> float:
    """The loss tolerance of one pair N->M, from ``loss_band`` or ``order_band``.

    With the elastic loader (``loss_band``) the document order depends on the
    DP size: only N->N resumes (the same side) read the reference's very
    batches (and must match it exactly, 0.0); N->M gets the measured
    data-order band. With the global-order loader (``order_band``) every pair
    reads the reference's batches: N->N gets the same-size rerun's band,
    N->M (another size or layout) the reduction-order band.
    """
    same = as_side(source) == as_side(target)
    if band.get("order") == "global":
        return band["band_same_size"] if same else band["band"]
    return 0.0 if same else band["band"]
