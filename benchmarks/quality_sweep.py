"""Held-out quality of AdamW, Gefen (block / factored second moment) and
GefenMuon, each at its own best learning rate, against seed noise (issue 48).

The debug recipe (``recipes/llama_gefen.toml``: Llama 3 debug model, the
embedded corpus, gloo CPU) trains on the corpus minus its held-out documents
(``gefen_tiny_train``) and the validator scores exactly the held-out ones
(``gefen_tiny_held_out``, 1 in 20 documents by content hash,
``gefen_titan.data.held_out``) every ``--eval-every`` steps and at the end.
Configurations (``--configs``):

* ``adamw``: ``--optimizer.name AdamW``;
* ``gefen-block``: Gefen, ``--optimizer.gefen.second_moment block`` (the default
  until these runs);
* ``gefen-factored``: Gefen, ``--optimizer.gefen.second_moment factored`` (the
  default since, ``"auto"`` under agreed blocking);
* ``gefen-muon``: ``recipes/llama_gefen_muon.toml`` (GefenMuon for the hidden
  matrices, Gefen for the rest, its second moment pinned to block: the
  2026-12-06 runs had it so, the default then). Both groups take ``[optimizer] lr`` (the
  GefenMuon group sets none; its ``match_rms_adamw`` puts its updates at
  AdamW's scale), so the sweep moves both together: their ratio stays 1.

Two phases, at ``--ranks`` ranks (global batch 4 x ranks x 256 tokens):

1. sweep: each configuration at each of its ``--lrs`` for ``--sweep-steps``
   steps, seed 0; the LR with the lowest final held-out loss is chosen (a
   choice at the edge of the grid is flagged: widen it);
2. seeds: each configuration at its chosen LR for ``--steps`` steps with
   ``--seeds`` seeds (``--debug.seed`` 0, 1, ...: the model init; the data
   order is the loader's, the same for every seed).

Default LRs, every configuration: 1e-3, 2e-3, 4e-3, a factor-2 grid around
the recipe's 2e-3 (best of 1e-3/2e-3/3e-3 for Gefen over 12 steps; AdamW and
GefenMuon's match_rms_adamw updates are at the same scale). Schedule, every
run: linear warmup over 5% of the steps (at least 2), then cosine decay to
0.1 x LR at the last step (``--lr_scheduler.total_steps`` = the run's steps).
A sweep shorter than the final runs favours larger LRs somewhat; that is the
price of sweeping at all on 2 CPU cores.

Resumable: every run writes ``--out/runs/<run>.json`` (configuration, LR,
seed, steps, flags, train and held-out curves, optimizer bytes/param, wall
and per-step seconds) and its log to ``--out/logs/``; a rerun with the same
``--out`` skips finished runs, so a long benchmark can be done in several
sessions. Results: ``--out/results.md`` (the table, also printed),
``--out/summary.json``, ``--out/eval_loss.png`` (held-out loss vs step, mean
over seeds; needs matplotlib). ``--dry-run`` prints the plan and its
estimated time.

    python scripts/bench_quality_sweep.py --dry-run
    python scripts/bench_quality_sweep.py --out outputs/quality_sweep
    python scripts/bench_quality_sweep.py --steps 40 --sweep-steps 20 --lrs 1e-3,4e-3 --out /tmp/qs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS: dict[str, tuple[str, list[str]]] = {  # name -> (recipe, flags)
    "adamw": ("llama_gefen.toml", ["--optimizer.name", "AdamW"]),
    "gefen-block": ("llama_gefen.toml", ["--optimizer.gefen.second_moment", "block"]),
    "gefen-factored": ("llama_gefen.toml", ["--optimizer.gefen.second_moment", "factored"]),
    "gefen-muon": ("llama_gefen_muon.toml", ["--optimizer.gefen.second_moment", "block"]),
}
DEFAULT_LRS = (1e-3, 2e-3, 4e-3)
BASELINE = "adamw"
HELD_OUT = "gefen_tiny_held_out"

# Measured on this project's 2-core AMD EPYC (AVX512) VM at 2 ranks, otherwise idle (60-step runs, one per
# configuration; with another job on the cores they were up to 2x slower): used by --dry-run and the ETA
# until the --out folder has finished runs of its own to measure.
DEFAULT_S_PER_STEP = {"adamw": 0.71, "gefen-block": 0.74, "gefen-factored": 1.16, "gefen-muon": 0.81}
DEFAULT_EVAL_S = 5.0  # one pass over the held-out documents at 2 ranks
STARTUP_S = 12.0  # torchrun, imports, model build, the first step's codebook learning

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_NUM = r"([0-9.]+|nan|inf)"
TRAIN_RE = re.compile(_STAMP + r" - \S+ - INFO - step:\s+(\d+)\s+loss:\s+" + _NUM)
EVAL_RE = re.compile(_STAMP + r" - \S+ - INFO - validate step:\s+(\d+)\s+loss:\s+" + _NUM)
BYTES_RE = re.compile(r"= ([0-9.]+) bytes/param")


def held_out_flags(steps: int, every: int) -> list[str]:
    """Train on the corpus minus the held-out documents; score exactly those
    every ``every`` steps (and at step 1, torchtitan's rule), and at ``steps``
    when ``every`` divides it."""
    return ["--dataloader.dataset", "gefen_tiny_train", "--validator.enable", "true",
            "--validator.dataloader.dataset", HELD_OUT, "--validator.steps", "-1",
            "--validator.freq", str(every), "--training.steps", str(steps)]


def schedule_flags(steps: int) -> list[str]:
    warmup = max(2, round(0.05 * steps))
    return ["--lr_scheduler.total_steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup),
            "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.decay_ratio", repr((steps - warmup) / steps),
            "--lr_scheduler.min_lr_factor", "0.1"]


def eval_every(steps: int, wanted: int) -> int:
    """The largest divisor of ``steps`` not above ``wanted`` (so the last step is scored)."""
    return max(d for d in range(1, max(1, min(wanted, steps)) + 1) if steps % d == 0)


@dataclasses.dataclass(frozen=True)
class Run:
    phase: str  # "sweep" or "seeds"
    config: str
    lr: float
    seed: int
    steps: int
    ranks: int
    every: int

    @property
    def name(self) -> str:
        return f"{self.phase}-{self.config}-lr{self.lr:g}-seed{self.seed}-steps{self.steps}-r{self.ranks}"

    @property
    def recipe(self) -> str:
        return CONFIGS[self.config][0]

    def flags(self) -> list[str]:
        return [*CONFIGS[self.config][1], "--optimizer.lr", repr(self.lr), "--debug.seed", str(self.seed),
                "--training.global_batch_size", str(4 * self.ranks), "--checkpoint.enable", "false",
                *held_out_flags(self.steps, self.every), *schedule_flags(self.steps)]

    def evals(self) -> int:
        return 1 + self.steps // self.every - (self.every == 1)


@dataclasses.dataclass
class Parsed:
    train: dict[int, float]
    eval: dict[int, float]
    bytes_per_param: float | None = None
    s_per_step: float | None = None  # median gap between train steps with no eval in between
    eval_s: float | None = None  # median length of one held-out pass


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse_log(log: str) -> Parsed:
    """Curves and timings from a run's log (every rank logs each line; the first is kept)."""
    log = _ANSI.sub("", log)
    train: dict[int, tuple[float, float]] = {}
    evals: dict[int, tuple[float, float]] = {}
    for regex, into in ((TRAIN_RE, train), (EVAL_RE, evals)):
        for stamp, step, loss in regex.findall(log):
            into.setdefault(int(step), (_seconds(stamp), float(loss)))
    gaps = [train[s][0] - train[s - 1][0] for s in train if s - 1 in train and s - 1 not in evals and s > 2]
    evals_s = [evals[s][0] - train[s][0] for s in evals if s in train]
    found = BYTES_RE.findall(log)
    return Parsed(train={s: v for s, (_, v) in sorted(train.items())},
                  eval={s: v for s, (_, v) in sorted(evals.items())},
                  bytes_per_param=float(found[0]) if found else None,
                  s_per_step=statistics.median(gaps) if gaps else None,
                  eval_s=statistics.median(evals_s) if evals_s else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_result(run: Run, out: Path) -> dict | None:
    path = out / "runs" / f"{run.name}.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    for key in ("train", "eval"):  # JSON keys are strings: the curves back with int steps
        result[key] = {int(k): v for k, v in result[key].items()}
    if result["flags"] != run.flags() or result["recipe"] != run.recipe:
        raise SystemExit(f"{path} was run with other flags than this benchmark would pass now:\n"
                         f"  then: {result['recipe']} {' '.join(result['flags'])}\n"
                         f"  now:  {run.recipe} {' '.join(run.flags())}\nuse another --out, or delete it")
    return result


def execute(run: Run, out: Path) -> dict:
    """Train ``run`` with torchrun; write its log and result JSON into ``out``."""
    with tempfile.TemporaryDirectory(prefix="quality_sweep-") as dump:  # traces and JSONL logs: nothing read here
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={run.ranks}",
               f"--master-port={_free_port()}", str(ROOT / "train.py"), "--job.config",
               str(ROOT / "recipes" / run.recipe), "--job.dump_folder", dump, *run.flags()]
        start = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - start
    log = proc.stdout + proc.stderr
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / f"{run.name}.log").write_text(log)
    parsed = parse_log(log)
    if proc.returncode or run.steps not in parsed.eval:
        raise SystemExit(f"{run.name} failed (exit {proc.returncode}; log: {out / 'logs' / run.name}.log):\n"
                         f"{_ANSI.sub('', log)[-3000:]}")
    result = {**dataclasses.asdict(run), "name": run.name, "recipe": run.recipe, "flags": run.flags(),
              "command": cmd, "wall_s": wall, **dataclasses.asdict(parsed)}
    path = out / "runs" / f"{run.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(result, indent=1))
    os.replace(path.with_suffix(".tmp"), path)
    return result


def finished_runs(out: Path) -> list[dict]:
    """Every run result in ``out`` (for timings: runs of other plans count too)."""
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def final_eval(result: dict) -> float:
    """The held-out loss at the run's last step (a diverged run's NaN as +inf, so it is never chosen)."""
    loss = result["eval"][result["steps"]]
    return math.inf if math.isnan(loss) else loss


# ------------------------------------------------------------------ timing


class Timing:
    """Seconds a run takes: per configuration, the medians of this ``--out``'s
    finished runs (training step, held-out pass, start-up), else the defaults."""

    def __init__(self, results: list[dict]) -> None:
        def median(key: str, config: str | None = None) -> float | None:
            values = [r[key] for r in results if r.get(key) is not None and config in (None, r["config"])]
            return statistics.median(values) if values else None

        self.step = {c: median("s_per_step", c) or DEFAULT_S_PER_STEP[c] for c in CONFIGS}
        self.measured = {c for c in CONFIGS if median("s_per_step", c) is not None}
        self.eval = median("eval_s") or DEFAULT_EVAL_S
        overheads = [r["wall_s"] - r["steps"] * r["s_per_step"] - Run(**_run_fields(r)).evals() * (r["eval_s"] or 0)
                     for r in results if r.get("s_per_step")]
        self.startup = statistics.median(overheads) if overheads else STARTUP_S

    def seconds(self, run: Run) -> float:
        return self.startup + run.steps * self.step[run.config] + run.evals() * self.eval


def _run_fields(result: dict) -> dict:
    return {f.name: result[f.name] for f in dataclasses.fields(Run)}


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def full_default_seconds(timing: Timing, ranks: int = 2) -> float:
    """A whole default benchmark (every configuration, 3 LRs x 200 sweep steps, 2 seeds x 1000 steps)."""
    runs = [Run("sweep", c, lr, 0, 200, ranks, eval_every(200, 200)) for c in CONFIGS for lr in DEFAULT_LRS]
    runs += [Run("seeds", c, DEFAULT_LRS[1], s, 1000, ranks, eval_every(1000, 50)) for c in CONFIGS for s in (0, 1)]
    return sum(timing.seconds(r) for r in runs)


# ------------------------------------------------------------------ the plan


def machine() -> str:
    import torch

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", lscpu).group(1).strip()
    except (OSError, AttributeError):
        model = platform.processor() or "unknown CPU"
    return (f"{model}, {os.cpu_count()} CPUs; torch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}")


def held_out_size() -> str:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from gefen_titan.data import corpus
    from gefen_titan.data.held_out import HELD_OUT_EVERY, split_texts

    train, held = split_texts(corpus.read_jsonl_texts(corpus.DEFAULT_DATASET_PATH))
    tok = HuggingFaceTokenizer(tokenizer_path=corpus.DEFAULT_TOKENIZER_PATH)
    tokens = sum(len(tok.encode(t, add_bos=True, add_eos=True)) - 1 for t in held)
    return (f"held out: 1 in {HELD_OUT_EVERY} documents by content hash, {len(held)} of {len(train) + len(held)} "
            f"documents, {tokens:,} scored tokens")


def parse_lrs(given: list[str], configs: list[str]) -> dict[str, list[float]]:
    """``--lrs 1e-3,2e-3`` (every configuration) and ``--lrs adamw=1e-3,2e-3`` (one)."""
    lrs = {c: list(DEFAULT_LRS) for c in configs}
    for item in given:
        name, eq, values = item.rpartition("=")
        targets = [name] if eq else configs
        if eq and name not in CONFIGS:
            raise SystemExit(f"--lrs {item}: unknown configuration {name!r} (known: {', '.join(CONFIGS)})")
        for c in targets:
            if c in lrs:
                lrs[c] = [float(v) for v in values.split(",") if v.strip()]
    return lrs


def sweep_runs(args, lrs: dict[str, list[float]]) -> list[Run]:
    """Seed 0 at every LR of a configuration that has more than one."""
    every = eval_every(args.sweep_steps, args.sweep_steps)
    return [Run("sweep", c, lr, 0, args.sweep_steps, args.ranks, every)
            for c, values in lrs.items() if len(values) > 1 for lr in values]


def seed_runs(args, chosen: dict[str, float]) -> list[Run]:
    every = eval_every(args.steps, args.eval_every or max(1, args.steps // 20))
    return [Run("seeds", c, lr, s, args.steps, args.ranks, every)
            for c, lr in chosen.items() for s in range(args.seeds)]


def choose(lrs: dict[str, list[float]], results: dict[str, dict]) -> dict[str, float | None]:
    """Each configuration's LR: its only one, or the sweep's best (None while the sweep is unfinished)."""
    chosen: dict[str, float | None] = {}
    for c, values in lrs.items():
        if len(values) == 1:
            chosen[c] = values[0]
            continue
        done = [r for r in results.values() if r["phase"] == "sweep" and r["config"] == c]
        chosen[c] = min(done, key=final_eval)["lr"] if len(done) == len(values) else None
    return chosen


# ------------------------------------------------------------------ the report


def _f(x: float | None, digits: int = 4) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def table(lrs: dict[str, list[float]], chosen: dict[str, float], results: dict[str, dict],
          steps: int) -> tuple[str, dict]:
    """The markdown table, and its numbers by configuration."""
    rows: dict[str, dict] = {}
    for c, lr in chosen.items():
        sweep = {r["lr"]: final_eval(r) for r in results.values() if r["phase"] == "sweep" and r["config"] == c}
        seeds = sorted((r for r in results.values() if r["phase"] == "seeds" and r["config"] == c and r["lr"] == lr),
                       key=lambda r: r["seed"])
        finals = [final_eval(r) for r in seeds]
        rows[c] = {"lr": lr, "sweep": sweep, "edge": len(lrs[c]) > 1 and lr in (min(lrs[c]), max(lrs[c])),
                   "finals": finals, "mean": statistics.fmean(finals), "spread": max(finals) - min(finals),
                   "bytes_per_param": seeds[0]["bytes_per_param"],
                   "s_per_step": statistics.median(r["s_per_step"] for r in seeds if r["s_per_step"]),
                   "s_per_step_min": min(r["s_per_step"] for r in results.values()
                                         if r["config"] == c and r["s_per_step"])}
    base = rows.get(BASELINE)
    lines = [f"| config | chosen LR | sweep: final held-out loss by LR | held-out loss at step {steps}, by seed | mean "
             f"| seed spread (max-min) | Δ mean vs AdamW | Δ / AdamW spread | opt B/param | s/step (median, min) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, row in rows.items():
        sweep = ", ".join(("**" if lr == row["lr"] else "") + f"{lr:g}: {_f(loss)}" + ("**" if lr == row["lr"] else "")
                          for lr, loss in sorted(row["sweep"].items())) or "— (one LR)"
        gap = row["mean"] - base["mean"] if base else None
        row["gap"] = gap
        row["gap_over_spread"] = gap / base["spread"] if base and base["spread"] > 0 else None
        lines.append(f"| {c} | {row['lr']:g}{' (grid edge)' if row['edge'] else ''} | {sweep} | "
                     f"{' / '.join(_f(x) for x in row['finals'])} | {_f(row['mean'])} | {_f(row['spread'])} | "
                     f"{'—' if c == BASELINE or gap is None else f'{gap:+.4f}'} | "
                     f"{'—' if c == BASELINE else _f(row['gap_over_spread'], 2)} | {_f(row['bytes_per_param'], 3)} | "
                     f"{_f(row['s_per_step'], 2)}, {_f(row['s_per_step_min'], 2)} |")
    return "\n".join(lines), rows


def plot(chosen: dict[str, float], results: dict[str, dict], path: Path, title: str) -> str:
    """Held-out loss vs step, mean over seeds (band: min to max), one line per configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed in this environment"
    fig, ax = plt.subplots(figsize=(8, 5))
    for c, lr in chosen.items():
        seeds = [r["eval"] for r in results.values() if r["phase"] == "seeds" and r["config"] == c and r["lr"] == lr]
        steps = sorted(set.intersection(*(set(e) for e in seeds)))
        steps = steps[1:] if len(steps) >= 3 else steps  # step 1's loss (~7.9) would flatten the rest
        runs = [[e[s] for s in steps] for e in seeds]
        ax.plot(steps, [statistics.fmean(v) for v in zip(*runs)], marker=".",
                label=f"{c} (lr {lr:g}, {len(runs)} seeds)")
        ax.fill_between(steps, [min(v) for v in zip(*runs)], [max(v) for v in zip(*runs)], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (mean over seeds; band: min-max)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from: " + ", ".join(CONFIGS))
    ap.add_argument("--lrs", action="append", default=[], metavar="[CONFIG=]LR,LR,...",
                    help="the sweep's LRs, for every configuration or (CONFIG=...) one; repeatable; one LR: no sweep "
                         f"(default {','.join(f'{x:g}' for x in DEFAULT_LRS)})")
    ap.add_argument("--sweep-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="held-out eval period of the seed runs (default steps/20; a divisor of --steps)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "quality_sweep"))
    ap.add_argument("--dry-run", action="store_true", help="print the planned runs and the estimated time")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: the table and plot of the runs finished in --out (a configuration with fewer "
                         "seed runs than --seeds is shown with those it has; one with none, left out)")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in CONFIGS for c in configs):
        ap.error(f"--configs: choose from {', '.join(CONFIGS)}")
    lrs = parse_lrs(args.lrs, configs)
    out = Path(args.out)
    setup = (f"Llama 3 debug model, {args.ranks} ranks (gloo CPU), global batch {4 * args.ranks} x 256 tokens; "
             f"train: gefen_tiny_train; {held_out_size()}; sweep {args.sweep_steps} steps (seed 0), "
             f"then {args.seeds} seeds x {args.steps} steps; warmup 5% + cosine to 0.1 x LR")
    header = f"machine: {machine()}\n{setup}"
    print(header, file=sys.stdout if args.dry_run else sys.stderr, flush=True)

    planned = sweep_runs(args, lrs)
    results = {r.name: res for r in planned if (res := load_result(r, out)) is not None}

    def plan() -> list[Run]:  # every run; the seed runs at the middle LR while their sweep is unfinished
        chosen = choose(lrs, results)
        return planned + seed_runs(args, {c: lr if lr is not None else lrs[c][len(lrs[c]) // 2]
                                          for c, lr in chosen.items()})

    if args.dry_run:
        chosen = choose(lrs, results)
        runs = plan()
        results |= {r.name: res for r in runs[len(planned):] if (res := load_result(r, out)) is not None}
        timing = Timing(finished_runs(out))
        print(f"\n{len(runs)} runs planned into {out}:")
        for r in runs:
            lr = f"{r.lr:g}" if r.phase == "sweep" or chosen[r.config] is not None else "best of sweep"
            print(f"  {r.phase:5} {r.config:15} lr {lr:13} seed {r.seed} {r.steps:5} steps, eval every {r.every:4}: "
                  + ("done" if r.name in results else f"~{_hours(timing.seconds(r))}"))
        left = sum(timing.seconds(r) for r in runs if r.name not in results)
        rates = ", ".join(f"{c} {timing.step[c]:.2f}" for c in CONFIGS)
        print(f"\nestimated time left: {_hours(left)} (s/step {rates}: "
              f"{'measured in this --out' if timing.measured else 'defaults: the 2-core VM, idle'}; "
              f"held-out pass {timing.eval:.1f} s; start-up {timing.startup:.0f} s)")
        print(f"a full default run (4 configs, 3 LRs x 200 sweep steps, 2 seeds x 1000 steps) at these rates: "
              f"~{_hours(full_default_seconds(timing, args.ranks))}")
        return

    start, count, total = time.time(), 0, len(planned) + len(configs) * args.seeds

    def progress(run: Run) -> None:
        nonlocal count
        count += 1
        if run.name in results:
            print(f"[{count}/{total}] {run.name}: already done (held-out {_f(final_eval(results[run.name]))})",
                  file=sys.stderr)
            return
        timing = Timing(finished_runs(out))
        t0 = time.time()
        print(f"[{count}/{total}] {run.name}: running (~{_hours(timing.seconds(run))})", file=sys.stderr)
        results[run.name] = execute(run, out)
        timing = Timing(finished_runs(out))
        left = sum(timing.seconds(r) for r in plan() if r.name not in results)
        print(f"[{count}/{total}] {run.name}: held-out {_f(final_eval(results[run.name]))} in "
              f"{time.time() - t0:.0f} s; elapsed {_hours(time.time() - start)}, ETA {_hours(left)}", file=sys.stderr)

    if not args.report:
        for run in planned:
            progress(run)
    chosen = choose(lrs, results)
    finals = seed_runs(args, {c: lr for c, lr in chosen.items() if lr is not None})
    results |= {r.name: res for r in finals if (res := load_result(r, out)) is not None}
    if args.report:  # the configurations with a finished seed run at their chosen LR
        chosen = {c: lr for c, lr in chosen.items()
                  if any(r.config == c and r.name in results for r in finals)}
    else:
        for run in finals:
            progress(run)

    text, rows = table(lrs, chosen, results, args.steps)
    timing = Timing(finished_runs(out))
    footer = (f"full default run (4 configs, 3 LRs x 200 sweep steps, 2 seeds x 1000 steps) at the s/step measured "
              f"here: ~{_hours(full_default_seconds(timing, args.ranks))}")
    note = plot(chosen, results, out / "eval_loss.png",
                f"loss on exactly the {HELD_OUT} documents (step 1 not shown)\n{args.ranks} ranks, global "
                f"batch {4 * args.ranks} x 256, {args.steps} steps at each configuration's chosen LR")
    report = f"{header}\n\n{text}\n\n{footer}\n{note}\n"
    print("\n" + report)
    (out / "results.md").write_text(report)
    (out / "summary.json").write_text(json.dumps({"header": header, "rows": rows, "lrs": lrs}, indent=1, default=str))
