"""End-to-end reshard validation: save at N ranks under one layout, resume at M under another.

The command line is ``gefen-titan validate`` (``python -m gefen_titan
validate``), from the installed package, with the same flags as the
checkout's ``scripts/validate_reshard.py`` (and its standard set,
``scripts/reshard_smoke.sh``); this module is what they run, and what
``tests/integration/test_validate_reshard.py`` tests. The recipe is a path
from the current directory; the runs are ``python -m torch.distributed.run
-m gefen_titan.train`` (``gefen_titan.validation.runs``).

A pair is ``SIDE:SIDE``; a side is ``N`` (N processes at the recipe's own
degrees, the data-parallel shard degree what they leave of N) or
``N@LAYOUT`` (the degrees of that side's runs, e.g. ``2@ep2``, ``4@tp2xpp2``;
``gefen_titan.validation.layouts``). Every side is checked before any run
(``preflight``). For every pair N:M, with S = ``steps_before`` and
K = ``steps_after``:

1. reference: an uninterrupted run at side N for S+K steps that checkpoints
   at step S (``training.steps = S+K`` in every run, so the LR schedule is the
   same). Its step-S checkpoint is exactly what an interrupted run saves.
   There is one reference per side (process count and layout) that appears
   in the pairs (targets too: they measure the loss band), shared by all
   pairs.
2. resume: the step-S checkpoint copied into the pair's own folder, loaded by
   ``torchrun --nproc_per_node M -m gefen_titan.train`` (same recipe, the
   target side's layout, ``--checkpoint.load_step S``), trained K more steps.
3. compare the state right after the load with the reference's state at the
   save (``gefen_titan.validation.hooks`` dumps both; it is switched on per run
   through torchtitan's ``--override.imports``):

   * agreed blocking (the default; checkpoint format v3): the dumps are the
     *global* state (every checkpoint entry gathered with ``full_tensor``,
     every parameter, and every rank's live periods, codebook, counters and
     hyperparameters). The load must reproduce it bit for bit, for every
     pair (splits and merges alike): ``compare_global.compare_global_state``.
   * per-rank blocking (``blocking="per_rank"``; format v1): the dumps are per
     rank; parameters bit-exact, Gefen momentum and second moment bit-exact
     wherever the v1 adapter promises it (a target shard on whole blocks of
     one source rank, with that rank's codebook adopted), otherwise within
     the adapter's error bounds; step counters equal; other optimizers'
     state bit-exact: ``compare_rank.compare_state``.

   Both report the first update the loaded state gives against the
   reference state's (the Adam-style direction m / (sqrt(v) + eps) for a zero
   new gradient: the state's whole share of the next step's error), and the
   loss of steps S+1..S+K against the reference, step by step:

   * elastic loader (torchtitan's per-rank document order): within a band
     measured on the reference runs (the resumed run reads other documents:
     the elastic loader hands the unread documents to M ranks, so the losses
     cannot be equal; ``bands.loss_band``); N->N resumes must match exactly.
   * global-order loader (``[dataloader] loader = "global_order"``): the
     resumed run must read the reference's very global batches (every run
     records them, ``report.compare_batches``), and its losses may differ only by
     arithmetic: by a same-size rerun's noise for N->N, and for N->M by what
     the references at the different sizes, which read the same batches
     too, differ by (another gradient reduction order): ``bands.order_band``.
     The deviation of every step is reported. And the parameters at step
     S+K must equal those of the uninterrupted run at the target side up
     to the same reduction order (``params``: read from both runs' last,
     model-only checkpoints, tolerance measured from the references as the
     loss's).

   ``bands.pair_loss_band`` picks the pair's tolerance.
4. prints a table (pair, loss deviation and band, state and first-update
   errors, whether the state is exact, checkpoint bytes, save/load seconds),
   writes ``report.json`` and one PNG figure per pair (``figure``: the loss
   curves, each step's deviation against the band and against the same
   resume with its optimizer state dropped, a run of its own per pair unless
   ``--no-dropped-state``, and the state check's verdict), and returns 1
   naming each pair and figure that broke its tolerance
   (``gefen_titan.validation.report``). A progress bar counts the runs on
   a terminal (``checkpoint.progress``).

The global batch is held fixed (``training.global_batch_size``, default 16;
torchtitan turns the per-rank ``local_batch_size`` into gradient
accumulation), so the curves at different DP sizes are comparable.

Backend: NCCL with one GPU per rank when ``torch.cuda.device_count()`` is at
least the largest rank count, else gloo on CPU (``CUDA_VISIBLE_DEVICES`` is
emptied for the runs); ``backend`` forces one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gefen_titan.checkpoint import progress
from gefen_titan.validation import launchers, layouts, params
from gefen_titan.validation.bands import loss_band, order_band, pair_loss_band
from gefen_titan.validation.dumps import dumps_params
from gefen_titan.validation.figure import path_for, plot_pair
from gefen_titan.validation.layouts import LayoutError, Side
from gefen_titan.validation.preflight import check_pairs
from gefen_titan.validation.recipes import resolve_recipe
from gefen_titan.validation.report import PairResult, compare_batches, evaluate, table
from gefen_titan.validation.runs import Run, Settings, global_order_batch, reference_run, resume_run
from gefen_titan.validation.summary import summary_lines, tolerances

__all__ = ["DESCRIPTION", "add_arguments", "choose_backend", "parse_pairs", "parse_sets", "validate"]

DESCRIPTION = ("End-to-end reshard validation: save at N ranks under one layout, resume at M under another "
               "(pairs N:M, or N@LAYOUT:M@LAYOUT, e.g. 2@ep2:1).")

Pair = tuple[Side, Side]


def parse_pairs(pairs: str | None, source: str | int | None = None,
                target: str | int | None = None) -> list[Pair]:
    """``"2:4,2@ep2:1"`` (or one ``source``/``target``) as pairs of sides
    (``layouts.parse_pairs``); SystemExit naming the pair and side that is wrong."""
    try:
        return layouts.parse_pairs(pairs, source, target)
    except LayoutError as e:
        raise SystemExit(f"--pairs: {e}") from None


def parse_sets(items: list[str]) -> list[str]:
    """``["section.key=value", ...]`` as torchtitan CLI overrides."""
    extra = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set {item}: expected SECTION.KEY=VALUE")
        extra += [f"--{key}", value]
    return extra


def choose_backend(requested: str, max_ranks: int) -> tuple[str, str]:
    """(backend, why): NCCL with a GPU per rank where enough GPUs are visible
    (or asked for: an error if there are too few), else gloo on CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl":
        if gpus < max_ranks:
            raise SystemExit(f"--backend nccl needs {max_ranks} GPUs, {gpus} visible")
        return "nccl", f"NCCL, one GPU per rank ({gpus} visible)"
    if requested == "gloo" or gpus < max_ranks:
        why = "forced" if requested == "gloo" else f"{gpus} GPU(s) visible, {max_ranks} needed for NCCL"
        return "gloo", f"gloo on CPU ({why})"
    return "nccl", f"NCCL, one GPU per rank ({gpus} visible)"


@dataclass
class _Runs:
    """The validation's runs: the uninterrupted references by side, the
    same-size rerun (global order only), the resumes by pair and, by pair,
    the same resume with the optimizer state dropped (None: not measured)."""

    references: dict[Side, Run]
    rerun: Run | None
    resumed: dict[Pair, Run]
    dropped: dict[Pair, Run | None]


def _settings(*, recipe: str, pairs: str | None, source: str | int | None, target: str | int | None,
              steps_before: int, steps_after: int, global_batch: int, local_batch: int | None,
              sets: list[str] | None, backend: str, blocking: str | None,
              launcher: str = "torchrun") -> tuple[Settings, list[Pair], str]:
    """The options checked (SystemExit naming the bad one; every side of
    every pair, ``preflight``) and turned into the runs' settings, the pairs
    and the backend's description."""
    try:
        resolve_recipe(recipe)
    except FileNotFoundError as e:
        raise SystemExit(f"--recipe: {e}") from None
    pair_list = parse_pairs(pairs, source, target)
    if steps_before < 1 or steps_after < 1:
        raise SystemExit("--steps-before and --steps-after must be >= 1")
    if blocking not in (None, "agreed", "per_rank"):
        raise SystemExit(f"--blocking must be agreed or per_rank, got {blocking!r}")
    chosen, backend_note = choose_backend(backend, max(max(a.nproc, b.nproc) for a, b in pair_list))
    if launcher == "fork" and (why := launchers.can_fork() or (
            "the fork launcher starts gloo ranks on CPU; NCCL runs need torchrun" if chosen != "gloo" else None)):
        raise SystemExit(f"--launcher fork: {why} (use --launcher torchrun, the default)")
    settings = Settings(recipe=recipe, steps_before=steps_before, steps_after=steps_after,
                        global_batch=global_batch or None, local_batch=local_batch, extra=parse_sets(sets or []),
                        backend=chosen, blocking=blocking, launcher=launcher)
    if any(not side.plain for pair in pair_list for side in pair) and (
            named := layouts.strip_degree_flags(settings.extra)[1]):
        raise SystemExit(f"--set parallelism.{named[0]}: would override every side's layout; name the degrees "
                         "in the pairs instead (N@LAYOUT, e.g. 2@tp2)")
    try:
        check_pairs(settings, pair_list)
    except LayoutError as e:
        raise SystemExit(f"--pairs: {e}") from None
    return settings, pair_list, backend_note


def _run(settings: Settings, pair_list: list[Pair], out_dir: Path, cache: Path | None,
         fault: str | None, global_batch: int | None, dropped_state: bool = True) -> _Runs | int:
    """Every run of the validation, or the exit code of the first that failed
    (2: a reference, nothing to validate against; 1: a resume, that pair fails).
    ``dropped_state`` (and no ``fault``): each pair's resume once more with the
    optimizer state dropped, the figure's measure of what the loss band lets through."""
    sides = sorted({side for pair in pair_list for side in pair}, key=Side.sort_key)
    measure_dropped = dropped_state and fault is None
    total = len(sides) + bool(global_batch) + len(pair_list) * (2 if measure_dropped else 1)
    with progress.bar(total, "validate: runs", unit="run") as bar:
        references: dict[Side, Run] = {}
        # References at every side of the pairs: the sources are what the resumes
        # are compared with; all of them together measure the loss band (and,
        # global order, the parameters' tolerance; the targets are what the
        # parameters are compared with).
        for side in sides:
            try:
                references[side] = reference_run(settings, side, out=out_dir, cache=cache)
            except RuntimeError as e:
                print(f"\nERROR: the reference run at {side.ranks()} failed: {e}", file=sys.stderr)
                return 2
            bar.update()
        rerun = None
        if global_batch:
            # The same-size rerun whose run-to-run noise sets the N->N tolerance.
            try:
                rerun = reference_run(settings, pair_list[0][0], out=out_dir, cache=cache, tag="rerun")
            except RuntimeError as e:
                print(f"\nERROR: the same-size rerun at {pair_list[0][0].ranks()} failed: {e}", file=sys.stderr)
                return 2
            bar.update()
        resumed, crashed, dropped = {}, [], {}
        for a, b in pair_list:
            try:
                resumed[(a, b)] = resume_run(settings, references[a], b, out_dir / f"{a.label}-to-{b.label}",
                                             fault=fault)
            except RuntimeError as e:
                crashed.append(f"{a.label}->{b.label}: the resumed run failed: {e}")
            bar.update()
        if crashed:
            print("\nFAILED:", file=sys.stderr)
            for line in crashed:
                print(f"  {line}", file=sys.stderr)
            return 1
        for a, b in pair_list if measure_dropped else ():
            # Not a verdict: a failed measurement leaves the figure without the line.
            try:
                dropped[(a, b)] = resume_run(settings, references[a], b,
                                             out_dir / f"{a.label}-to-{b.label}-optimizer-dropped",
                                             fault="drop-optimizer", measure=True)
            except RuntimeError as e:
                print(f"  (the optimizer-dropped resume {a.label}->{b.label} failed, not drawn: "
                      f"{str(e).splitlines()[0]})", flush=True)
                dropped[(a, b)] = None
            bar.update()
    return _Runs(references, rerun, resumed, dropped)


def _final_params(settings: Settings, pair: Pair, runs: _Runs,
                  band: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Global order: the pair's parameters at step S+K against the
    uninterrupted run at its target side, and the failure lines."""
    a, b = pair
    dev = params.param_deviation(params.final_checkpoint(runs.resumed[pair], settings),
                                 params.final_checkpoint(runs.references[b], settings))
    tolerance = params.pair_param_band(a, b, band)
    problems = params.param_problems(f"{a.label}->{b.label}", b, dev, tolerance, settings.total_steps)
    return {**dev, "tolerance": tolerance, "compared_with": b.key}, problems


def _judge(settings: Settings, pair_list: list[Pair], runs: _Runs,
           global_batch: int | None) -> tuple[list[PairResult], dict[str, Any], dict[str, Any] | None]:
    """Each pair's verdict against its reference, the loss band they used,
    and (global order) the parameters' band."""
    refs = runs.references
    band = order_band(refs, runs.rerun, settings) if global_batch else loss_band(refs, settings)
    pband = params.param_band(refs, runs.rerun, settings) if global_batch else None
    results = [evaluate(settings, refs[a], runs.resumed[(a, b)], pair_loss_band(a, b, band), global_batch,
                        _final_params(settings, (a, b), runs, pband) if pband is not None else None)
               for a, b in pair_list]
    for r, pair in zip(results, pair_list):
        if (run := runs.dropped.get(pair)) is not None:
            r.dropped_losses = run.losses
    if global_batch:
        # The DP-invariance the comparison rests on: every uninterrupted run
        # read the same global batches, at every size and layout.
        first, *others = sorted(refs, key=Side.sort_key)
        for side in others:
            problems = compare_batches(refs[first], refs[side], global_batch, range(1, settings.total_steps + 1))
            where = f"{side.nproc} rank(s)" if side.plain else side.label
            results[0].failures += [f"references at {first.label} and {where}: {p}" for p in problems]
    return results, band, pband


def validate(*, recipe: str, pairs: str | None = None, source: str | int | None = None,
             target: str | int | None = None, steps_before: int = 4, steps_after: int = 3, global_batch: int = 16,
             local_batch: int | None = None, sets: list[str] | None = None,
             out: str = "outputs/validate_reshard", plot_path: str | None = None, backend: str = "auto",
             reference_cache: str | None = None, blocking: str | None = None,
             inject_fault: str | None = None, launcher: str = "torchrun", dropped_state: bool = True) -> int:
    """The whole validation (``gefen-titan validate`` and
    ``scripts/validate_reshard.py`` pass their options): the options
    checked, the runs, each pair judged, the report written and printed.

    ``recipe`` is a path from the current directory (SystemExit naming it
    when there is no such file).

    ``dropped_state``: also resume each pair with its optimizer state dropped
    (one more run a pair), for the figure.

    Returns 0 when every pair is within tolerance, 1 naming each pair and
    figure that is not (or each resume that failed), 2 when a reference run
    failed (nothing to validate against).
    """
    settings, pair_list, backend_note = _settings(
        recipe=recipe, pairs=pairs, source=source, target=target, steps_before=steps_before,
        steps_after=steps_after, global_batch=global_batch, local_batch=local_batch, sets=sets,
        backend=backend, blocking=blocking, launcher=launcher)
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(reference_cache).resolve() if reference_cache else None
    png = Path(plot_path).resolve() if plot_path else out_dir / "loss_curves.png"
    print(f"validate_reshard: {recipe}, pairs {', '.join(f'{a.label}->{b.label}' for a, b in pair_list)}, "
          f"S={settings.steps_before}, K={settings.steps_after}, global batch {settings.global_batch or 'recipe'}, "
          f"blocking {blocking or 'of the recipe'}; backend: {backend_note}", flush=True)

    begin = time.monotonic()
    order_batch = global_order_batch(settings)
    runs = _run(settings, pair_list, out_dir, cache, inject_fault, order_batch, dropped_state)
    if isinstance(runs, int):
        return runs
    results, band, pband = _judge(settings, pair_list, runs, order_batch)
    n_params = dumps_params(next(iter(runs.references.values())).dumps("save", settings.steps_before))
    plots = {r.pair: str(plot_pair(r, settings, path_for(png, r.pair, len(results)), runs.references.get(b)))
             for r, (_, b) in zip(results, pair_list)}
    used = sorted({r.state.get("blocking") or "?" for r in results})
    report = {
        "recipe": recipe, "backend": settings.backend, "backend_note": backend_note, "blocking": used,
        "settings": asdict(settings), "loss_band": band, "param_band": pband,
        "data_order": "global" if order_batch else "per_dp_size",
        "tolerances": tolerances(used, order_batch),
        "parameters": n_params, "plots": plots, "fault": inject_fault,
        "pairs": [asdict(r) for r in results],
        "seconds": time.monotonic() - begin,
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))

    print()
    print(table(results, n_params))
    print("\n".join(summary_lines(results, band, used, runs.references, order_batch, backend_note, pband)))
    figures = "\n".join(f"figure: {p}" for p in plots.values())
    print(f"{figures}\nreport: {out_dir / 'report.json'}  ({time.monotonic() - begin:.0f} s)")
    failures = [f for r in results for f in r.failures]
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        for p in plots.values():
            print(f"  figure: {p}", file=sys.stderr)
        print(f"  report: {out_dir / 'report.json'}", file=sys.stderr)
        return 1
    print("all pairs within tolerance")
    return 0


def add_arguments(ap: argparse.ArgumentParser, *, recipe_default: str | None = None) -> None:
    """The validation's flags (``gefen-titan validate``, ``scripts/validate_reshard.py``).

    ``recipe_default``: the checkout's script has a default recipe; the
    package has none (its recipes are the user's), so there ``--recipe`` is required.
    """
    ap.add_argument("--recipe", default=recipe_default, required=recipe_default is None,
                    help="the recipe, a path from the current directory"
                    + (f" (default {recipe_default})" if recipe_default else ""))
    ap.add_argument("--from", dest="source", metavar="SIDE", help="the saving side: N or N@LAYOUT (e.g. 2@ep2)")
    ap.add_argument("--to", dest="target", metavar="SIDE", help="the resuming side: N or N@LAYOUT")
    ap.add_argument("--pairs", metavar="SIDE:SIDE,...",
                    help="comma-separated pairs, e.g. 2:4,4:2,2:1 or 2@ep2:2,2@ep2:1. A side is N (processes, "
                         "the recipe's degrees, FSDP takes the rest) or N@LAYOUT: degrees joined by x from "
                         f"{', '.join(layouts.DEGREES)} (e.g. 4@tp2xep2); a degree not named is 1")
    ap.add_argument("--steps-before", type=int, default=4, help="S: checkpoint step (default 4)")
    ap.add_argument("--steps-after", type=int, default=3, help="K: steps after the resume (default 3)")
    ap.add_argument("--global-batch", type=int, default=16,
                    help="training.global_batch_size for every run (0: the recipe's)")
    ap.add_argument("--local-batch", type=int, help="training.local_batch_size (default: the recipe's)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="another override for every run (a side's parallelism: name it in the pair, N@LAYOUT)")
    ap.add_argument("--blocking", choices=("agreed", "per_rank"),
                    help="optimizer.blocking.mode for every run (default: the recipe's, normally agreed)")
    ap.add_argument("--out", default="outputs/validate_reshard", help="folder for the runs, report.json and the plot")
    ap.add_argument("--plot", dest="plot_path", metavar="PNG",
                    help="the figure's PNG path (default <out>/loss_curves.png); with several pairs one figure "
                         "a pair, <stem>-<A>-to-<B>.png")
    ap.add_argument("--no-dropped-state", dest="dropped_state", action="store_false",
                    help="skip the extra resume per pair with the optimizer state dropped (the figure's measure "
                         "of what the loss band alone would let through)")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    ap.add_argument("--launcher", choices=launchers.LAUNCHERS, default="torchrun",
                    help="how each run's ranks start: torchrun (default), or fork: forked from one server that "
                         "imported torch and torchtitan once (CPU-only torch, gloo; the same runs, faster to start)")
    ap.add_argument("--reference-cache", help="keep reference runs here and reuse those of the same identity")
    ap.add_argument("--inject-fault", choices=("drop-optimizer",), help=argparse.SUPPRESS)

