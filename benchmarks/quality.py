"""Training quality of agreed blocking vs per-rank blocking vs one process.

Agreed blocking restricts the block periods (divisors of the row length, cut
by the TP degrees a checkpoint may move to) and learns one codebook from the
whole gradient instead of one per rank from its shard. This measures what
that costs: the debug recipe trained for ``--steps`` steps with

* ``agreed``: the default, at ``--ranks`` ranks;
* ``per_rank``: gefen-x's own per-rank learning, at ``--ranks`` ranks;
* ``one process``: gefen-x's own learning on whole tensors (1 rank,
  gradient accumulation to the same global batch);

and Gefen's own run-to-run noise: the per-rank configuration again with
another ``debug.seed`` (another init and data order), whose curve differs
from the first only by chance. Each curve is compared with the per-rank
curve: mean and max |Δloss| over the run and over its last quarter, beside
the same figures for the seed-to-seed noise. Also the optimizer state
bytes/param each configuration logs.

``--runs`` picks the configurations (default: the four above) and may add

* ``gefen-muon``: ``recipes/llama_gefen_muon.toml`` (GefenMuon for the hidden
  matrices, Gefen for the rest; agreed blocking), at ``--ranks`` ranks;
* ``adamw``: the same recipe with ``--optimizer.name AdamW``, at ``--ranks``;

then GefenMuon's final loss and last-quarter mean loss are printed against
Gefen's (``agreed``, the default blocking) and AdamW's, same run, same data.
Curves are compared with ``per_rank``'s, or with the first run when it is
not among ``--runs``.

    python scripts/bench_quality.py --steps 100
    python scripts/bench_quality.py --steps 100 --runs agreed,adamw,gefen-muon
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([0-9.]+)")
BYTES_RE = re.compile(r"= ([0-9.]+) bytes/param")


def train(nproc: int, steps: int, dump: str, *overrides: str, port: int,
          recipe: str = "llama_gefen.toml") -> tuple[dict[int, float], float]:
    """Losses by step and the logged optimizer bytes/param of one run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master-port={port}",
           str(ROOT / "train.py"), "--job.config", str(ROOT / "recipes" / recipe),
           "--job.dump_folder", dump, "--training.steps", str(steps), "--checkpoint.enable", "false",
           "--lr_scheduler.total_steps", str(steps), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"training failed ({' '.join(overrides)}):\n{log[-4000:]}")
    losses: dict[int, float] = {}
    for step, loss in STEP_RE.findall(log):
        losses.setdefault(int(step), float(loss))
    return losses, float(BYTES_RE.findall(log)[0])


def deviation(a: dict[int, float], b: dict[int, float]) -> dict[str, float]:
    steps = sorted(set(a) & set(b))
    tail = steps[-max(1, len(steps) // 4):]
    d = [abs(a[s] - b[s]) for s in steps]
    dt = [abs(a[s] - b[s]) for s in tail]
    return {"mean": sum(d) / len(d), "max": max(d), "tail_mean": sum(dt) / len(dt), "tail_max": max(dt)}


def tail_mean(curve: dict[int, float]) -> float:
    """Mean loss over the run's last quarter (less noisy than the last step's)."""
    steps = sorted(curve)
    tail = steps[-max(1, len(steps) // 4):]
    return sum(curve[s] for s in tail) / len(tail)


def configurations(n: int) -> dict[str, tuple[int, list[str], str]]:
    """Every configuration --runs may name: (ranks, overrides, recipe)."""
    batch = ["--training.global_batch_size", str(4 * n)]
    return {
        "per_rank": (n, ["--optimizer.blocking.mode", "per_rank", *batch], "llama_gefen.toml"),
        "agreed": (n, ["--optimizer.blocking.mode", "agreed", *batch], "llama_gefen.toml"),
        "one process": (1, ["--optimizer.blocking.mode", "per_rank", *batch], "llama_gefen.toml"),
        "per_rank, seed 1 (noise)": (n, ["--optimizer.blocking.mode", "per_rank", "--debug.seed", "1", *batch],
                                     "llama_gefen.toml"),
        "adamw": (n, ["--optimizer.name", "AdamW", *batch], "llama_gefen.toml"),
        "gefen-muon": (n, ["--optimizer.blocking.mode", "agreed", *batch], "llama_gefen_muon.toml"),
    }


# --runs names (no commas, no spaces) -> configurations
RUN_NAMES = {"per_rank": "per_rank", "agreed": "agreed", "one-process": "one process",
             "noise": "per_rank, seed 1 (noise)", "adamw": "adamw", "gefen-muon": "gefen-muon"}
DEFAULT_RUNS = ("per_rank", "agreed", "one-process", "noise")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                    help="comma-separated configurations, from: " + ", ".join(RUN_NAMES))
    ap.add_argument("--json", default="", help="also write the curves and figures here")
    args = ap.parse_args(argv)
    n = args.ranks
    known = configurations(n)
    given = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in given if r not in RUN_NAMES]
    if bad or not given:
        ap.error(f"--runs: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(RUN_NAMES)}")
    names = [RUN_NAMES[r] for r in given]
    runs = {name: known[name] for name in names}
    curves, sizes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (nproc, overrides, recipe)) in enumerate(runs.items()):
            curves[name], sizes[name] = train(nproc, args.steps, os.path.join(tmp, str(i)), *overrides,
                                              port=29590 + i, recipe=recipe)
            print(f"done: {name}", file=sys.stderr)
    ref_name = "per_rank" if "per_rank" in runs else names[0]
    ref = curves[ref_name]
    print(f"\nLlama 3 debug recipe, {args.steps} steps, global batch {4 * n} x 256 tokens, gloo CPU; "
          f"|loss - {ref_name} loss|\n")
    print("| configuration | ranks | opt B/param | final loss | mean | max | last-quarter mean | last-quarter max |")
    print("|---|---|---|---|---|---|---|---|")
    table = {}
    for name, (nproc, _, _) in runs.items():
        last = max(curves[name])
        dev = deviation(curves[name], ref) if name != ref_name else None
        table[name] = {"ranks": nproc, "bytes_per_param": sizes[name], "final": curves[name][last], "vs_per_rank": dev,
                       "tail_mean_loss": tail_mean(curves[name])}
        cells = ["—"] * 4 if dev is None else [f"{dev[k]:.4f}" for k in ("mean", "max", "tail_mean", "tail_max")]
        print(f"| {name} | {nproc} | {sizes[name]:.3f} | {curves[name][last]:.4f} | " + " | ".join(cells) + " |")
    if {"per_rank", "agreed", "per_rank, seed 1 (noise)"} <= set(runs):
        noise = table["per_rank, seed 1 (noise)"]["vs_per_rank"]
        agreed = table["agreed"]["vs_per_rank"]
        print(f"\nagreed vs per_rank, last quarter: mean |Δ| {agreed['tail_mean']:.4f} against seed noise "
              f"{noise['tail_mean']:.4f} (x{agreed['tail_mean'] / noise['tail_mean']:.2f})")
    if "gefen-muon" in table:
        m = table["gefen-muon"]
        for base, label in (("agreed", "Gefen (agreed)"), ("per_rank", "Gefen (per_rank)"), ("adamw", "AdamW")):
            if base in table:
                b = table[base]
                print(f"GefenMuon vs {label}: final loss {m['final']:.4f} vs {b['final']:.4f} "
                      f"(Δ {m['final'] - b['final']:+.4f}, x{m['final'] / b['final']:.3f}); last-quarter mean loss "
                      f"{m['tail_mean_loss']:.4f} vs {b['tail_mean_loss']:.4f} "
                      f"(Δ {m['tail_mean_loss'] - b['tail_mean_loss']:+.4f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"curves": curves, "table": table}, indent=1))


if __name__ == "__main__":
    main()
