"""One pair's picture: the loss curves, the deviation against the band and a dropped state, the verdict.

A validation's question is whether the resume carried the state over. The
loss band alone cannot answer it: at these run lengths it is wider than
what a resume that dropped the whole optimizer state deviates by
(docs/validation.md, "A broken resume fails"). So each pair gets a figure
of its own (``path_for``), at least 1200 px wide, with three parts:

* left, the losses: the uninterrupted reference at the source side, the
  uninterrupted run at the target side (where it differs), the resumed run
  and, where it was measured (``PairResult.dropped_losses``), the same
  resume with the optimizer state dropped;
* right, on its own axis, each step's |loss - reference| after the resume
  for the resumed run and for the dropped-state run, against the band;
* below, the verdict in words: the state check's (the sharp one: bit-exact
  or not, the first problem), the loss check's and the figure's overall.

The title names the recipe, the pair and both sides' layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gefen_titan.validation.layouts import parse_side
from gefen_titan.validation.report import PairResult, state_verdict
from gefen_titan.validation.runs import Run, Settings

__all__ = ["layout_text", "pair_figure", "path_for", "plot_pair", "ranks_text"]

WIDTH_PX, HEIGHT_PX, DPI = 1500, 640, 100


def ranks_text(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def layout_text(nproc: int, degrees: dict[str, int]) -> str:
    """``2 ranks (fsdp 2)``, ``4 ranks (fsdp 2 x tp 2)``: the process count and every degree above 1."""
    named = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1)
    return ranks_text(nproc) + (f" ({named})" if named else "")


def path_for(base: Path, pair: str, n_pairs: int) -> Path:
    """The figure of one pair: ``base`` itself when there is one pair, else ``<stem>-<pair><suffix>``."""
    if n_pairs == 1:
        return base
    return base.with_name(f"{base.stem}-{pair.replace('->', '-to-').replace('@', 'at')}{base.suffix}")


def _deviations(losses: dict[int, float], reference: dict[int, float], steps: range) -> dict[int, float]:
    return {t: abs(losses[t] - reference[t]) for t in steps if t in losses and t in reference}


def _verdict_lines(r: PairResult, dropped: dict[int, float]) -> list[tuple[str, str]]:
    """(text, colour) lines under the plots."""
    state = r.state
    blocking = state.get("blocking") or "?"
    verdict = state_verdict(state)
    if state.get("exact"):
        line = (f"State after the load: BIT-EXACT ({blocking} blocking): every checkpoint entry and parameter, and "
                "every rank's periods, codebook, counters and hyperparameters, equal to the save's")
    else:
        first = next(iter(state.get("problems") or []), "")
        first = first if len(first) <= 140 else first[:139] + "…"  # the whole list is in the output
        line = f"State after the load: {verdict} ({blocking} blocking)" + (f": {first}" if first else "")
    lines = [(line, "tab:green" if state.get("exact") else "tab:red")]
    within = r.loss_deviation <= r.loss_band
    lines.append((f"Loss after the resume: max |loss - reference| {r.loss_deviation:.4f} "
                  f"{'<=' if within else '>'} band {r.loss_band:.4f}", "black" if within else "tab:red"))
    if dropped:
        worst = max(dropped.values())
        inside = worst <= r.loss_band
        lines.append((f"The same resume with the optimizer state dropped: max |loss - reference| {worst:.4f}, "
                      + ("inside the band: the loss alone does not tell the two apart; the state check does"
                         if inside else "outside the band"), "dimgrey"))
    n = len(r.failures)
    lines.append(("PASS" if not n else f"FAIL: {n} figure{'s' if n != 1 else ''} out of tolerance (see the output)",
                  "tab:green" if not n else "tab:red"))
    return lines


def plot_pair(r: PairResult, settings: Settings, path: Path, uninterrupted_at_target: Run | None = None) -> Path:
    """Write one pair's figure to ``path`` (PNG) and return it."""
    fig = pair_figure(r, settings, uninterrupted_at_target)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def pair_figure(r: PairResult, settings: Settings, uninterrupted_at_target: Run | None = None) -> Figure:
    """One pair's figure (``plot_pair`` writes it)."""
    s = settings.steps_before
    window = range(s + 1, settings.total_steps + 1)
    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)  # a bare Figure: Agg, no global backend
    grid = fig.add_gridspec(2, 2, height_ratios=[4, 1.25], width_ratios=[3, 2], hspace=0.35, wspace=0.18)
    ax, dev_ax = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    text_ax = fig.add_subplot(grid[1, :])
    text_ax.axis("off")

    source, target = r.layouts.get("source", {}), r.layouts.get("target", {})
    src_n, tgt_n = parse_side(str(r.source)).nproc, parse_side(str(r.target)).nproc
    src_text, tgt_text = layout_text(src_n, source), layout_text(tgt_n, target)

    def curve(a: Any, losses: dict[int, float], style: str, **kw: Any) -> None:
        pts = sorted(losses.items())
        a.plot([t for t, _ in pts], [v for _, v in pts], style, **kw)

    if uninterrupted_at_target is not None and r.target != r.source:
        curve(ax, uninterrupted_at_target.losses, "-", lw=1.2, color="grey", alpha=0.7,
              label=f"uninterrupted at {tgt_text}")
    curve(ax, r.reference_losses, "-o", ms=4, color="tab:blue", label=f"reference: uninterrupted at {src_text}")
    if r.dropped_losses:
        curve(ax, {t: v for t, v in r.dropped_losses.items() if t > s}, "x:", ms=6, color="tab:purple",
              label="resumed with the optimizer state dropped")
    curve(ax, {t: v for t, v in r.resumed_losses.items() if t > s}, "s--", ms=5,
          color="tab:red" if r.failures else "tab:orange", label=f"resumed at {tgt_text}")
    ax.axvline(s + 0.5, color="grey", lw=0.8, ls=":")
    ax.annotate(f"save at step {s}", (s + 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(4, -12),
                textcoords="offset points", fontsize=8, color="grey")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 2.5
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")

    resumed_dev = _deviations(r.resumed_losses, r.reference_losses, window)
    dropped_dev = _deviations(r.dropped_losses or {}, r.reference_losses, window)
    steps = list(window)
    dev_ax.fill_between([steps[0] - 0.4, steps[-1] + 0.4], 0, r.loss_band, color="tab:blue", alpha=0.12, lw=0,
                        label=f"loss band (tolerance) {r.loss_band:.4f}")
    dev_ax.axhline(r.loss_band, color="tab:blue", lw=1)
    if dropped_dev:
        curve(dev_ax, dropped_dev, "x:", ms=7, color="tab:purple", label="optimizer state dropped")
    curve(dev_ax, resumed_dev, "s-", ms=5, color="tab:red" if r.failures else "tab:orange", label="resumed")
    dev_ax.set_xticks(steps)
    top = max([r.loss_band, *resumed_dev.values(), *dropped_dev.values()])
    dev_ax.set_ylim(0, top * 1.45 if top > 0 else 1e-5)  # room for the legend above the band's line
    dev_ax.set_xlabel("step after the resume")
    dev_ax.set_ylabel("|loss - reference|")
    dev_ax.set_title("Deviation from the reference, per step", fontsize=10)
    dev_ax.legend(fontsize=8, loc="upper left")

    for i, (line, colour) in enumerate(_verdict_lines(r, dropped_dev)):
        text_ax.text(0.0, 1.0 - i * 0.27, line, transform=text_ax.transAxes, fontsize=9.5, color=colour,
                     va="top", weight="bold" if i in (0, 3) or line.startswith(("PASS", "FAIL")) else "normal")
    fig.suptitle(f"{Path(settings.recipe).name}: pair {r.pair}, saved at {src_text}, resumed at {tgt_text} "
                 f"(step {s}, then {settings.steps_after} more; {r.backend})", fontsize=11)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.89, bottom=0.03)
    return fig
