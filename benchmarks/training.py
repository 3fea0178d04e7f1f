"""Training cost inside torchtitan: the same recipe with Gefen and with AdamW (and GefenMuon), one run.

For each model (``--models``: the debug recipe's model and gefen_titan's
``150M`` flavor) and each optimizer, ``torchrun`` trains
``recipes/llama_gefen.toml`` at ``--ranks`` ranks through torchtitan's own
``Trainer`` (recipe, data, FSDP2, loss, LR schedule as in a real run; no
checkpoints) with the optimizer swapped by ``--optimizer.name``. A worker
wraps the trainer's ``train_step`` and its optimizer container's ``step``
with timers, so the figures are the steps themselves, not torchtitan's
logging intervals (whose first one also counts the set-up):

* first-step time (Gefen's includes the agreement of periods and codebook,
  also timed on its own),
  steady-state step time (median of steps 3..N) and the optimizer's share of
  it (median ``optimizers.step()``);
* tokens/s of the whole job at the steady step time;
* peak memory per rank during training (CUDA: ``max_memory_allocated``; CPU:
  the process's peak RSS over the training loop, ``benchmarks.
  rss``), the worst rank;
* optimizer state bytes/param (the container's ``state_bytes()``), over the
  whole job and per rank (the worst rank's state over the model's parameters);
* with ``--optimizers ...,GefenMuon``: ``recipes/llama_gefen_muon.toml`` (the
  same overrides plus its ``[[optimizer.param_groups]]``: GefenMuon for the
  hidden matrices, Gefen for the rest), and, as arithmetic from the model's
  shapes and the run's periods, what gefen-x's ``sharded_mode="exact"`` would
  keep on every rank for those matrices (full-matrix codes, block magnitudes,
  NorMuon rows, codebook); and from GefenMuon's step statistics
  (``MuonStepStats``), per steady step and the busiest rank: the seconds
  of Newton-Schulz (its share of the optimizer step), the bytes exchanged,
  and the peak bytes in flight against the step's bound. With 1 among
  ``--ranks``, each other world size's GefenMuon optimizer step is printed
  as a ratio to 1 rank's. ``--ranks 2,4`` runs every optimizer at each world size.

The slowest rank's time is taken for every step. Few steps and a short
sequence at 150M (defaults below) keep it to minutes on a CPU; say so when
quoting the figures.

    python scripts/bench_training.py                       # debug (10 steps) and 150M (4 steps, seq 128)
    python scripts/bench_training.py --models debug --steps 20
    python scripts/bench_training.py --models debug --ranks 2,4 --optimizers Gefen,AdamW,GefenMuon
    python scripts/bench_training.py --models 150M --ranks 1 --offload   # --training.enable_cpu_offload

With ``--offload`` every run trains with FSDP2's CPU offload: on a GPU host the
shards, gradients and optimizer state live in host memory and the step runs
there. On a CPU host all memory is host memory, so its peak RSS also holds
what a GPU host keeps on the device (activations, gathered parameters): an
upper bound; the optimizer state's bytes per parameter are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/llama_gefen.toml"
MUON_RECIPE = "recipes/llama_gefen_muon.toml"  # llama_gefen.toml plus GefenMuon's param groups
# model -> (flavor, steps, seq_len, local batch) defaults
MODELS = {"debug": ("debugmodel", 10, 256, 4), "150M": ("150M", 4, 128, 2)}
OPTIMIZERS = ("Gefen", "AdamW")  # the default; GefenMuon on request (--optimizers)
CHOICES = (*OPTIMIZERS, "GefenMuon")


def muon_exact(optimizers) -> dict:
    """gefen-x ``sharded_mode="exact"``'s state on every rank for the GefenMuon
    matrices (arithmetic from global shapes and the run's periods), and the
    largest dense fp32 matrix an owner gathers (one at a time)."""
    from gefen_titan.optim import gefenx as gx

    total = inflight = numel = 0
    for optim in optimizers:
        if not gx.is_gefen_muon(optim):
            continue
        total += 256 * 4  # the codebook
        for group in optim.param_groups:
            for p in group["params"]:
                n, period = p.numel(), gx.period(optim, p) or 1
                rows = p.shape[0] * 4 if group.get("normuon") else 0
                total += n + 4 * -(-n // period) + rows
                inflight, numel = max(inflight, 4 * n), numel + n
    return {"exact_bytes": total, "inflight_bytes": inflight, "muon_numel": numel}


# --------------------------------------------------------------------- worker
def _worker(out: str, train_args: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger

    from benchmarks.rss import PeakRSS
    from gefen_titan.train import build_config

    init_logger()
    config = build_config(train_args)
    sl.init_structured_logger(source="training", output_dir=config.dump_folder,
                              enable=config.debug.enable_structured_logging)
    trainer = config.build()
    cuda = torch.cuda.is_available() and trainer.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    steps, opt_steps = [], []
    train_step, opt_step = trainer.train_step, trainer.optimizers.step

    def timed_train_step(*a, **k):
        sync()
        t0 = time.perf_counter()
        result = train_step(*a, **k)
        sync()
        steps.append(time.perf_counter() - t0)
        return result

    muon_stats = trainer.optimizers.step_stats("GefenMuon")
    muon_steps: list[dict] = []

    def timed_opt_step(*a, **k):
        for st in muon_stats:
            st.reset()
            st.sync_cuda = cuda
        sync()
        t0 = time.perf_counter()
        result = opt_step(*a, **k)
        sync()
        opt_steps.append(time.perf_counter() - t0)
        if muon_stats:
            muon_steps.append({"ns_s": sum(st.ns_seconds for st in muon_stats),
                               "muon_s": sum(st.seconds for st in muon_stats),
                               "sent": sum(st.bytes_sent for st in muon_stats),
                               "received": sum(st.bytes_received for st in muon_stats),
                               "peak": max(st.peak_inflight_bytes for st in muon_stats),
                               "bound": max(st.bound_bytes for st in muon_stats),
                               "buckets": sum(st.buckets for st in muon_stats)})
        return result

    trainer.train_step = timed_train_step
    trainer.optimizers.step = timed_opt_step
    agreement_s: list[float] = []
    agreement = getattr(trainer.optimizers, "agreement", None)
    if agreement is not None:  # Gefen, agreed blocking: time the first step's agreement on its own
        maybe_agree = agreement.maybe_agree

        def timed_agree(*a, **k):
            needed = agreement.needed
            sync()
            t0 = time.perf_counter()
            result = maybe_agree(*a, **k)
            sync()
            if needed:
                agreement_s.append(time.perf_counter() - t0)
            return result

        agreement.maybe_agree = timed_agree
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        with PeakRSS() as rss:
            trainer.train()
        state_bytes, numel = trainer.optimizers.state_bytes()
        exact = muon_exact(trainer.optimizers.optimizers)
        peak = torch.cuda.max_memory_allocated() if cuda else rss.peak
        mine = {"steps": steps, "opt_steps": opt_steps, "muon_steps": muon_steps, "agreement_s": sum(agreement_s),
                "peak": peak,
                "state_bytes": state_bytes, "numel": numel, **exact,
                "memory": "cuda max_memory_allocated" if cuda else f"peak RSS ({rss.method})"}
        world = dist.get_world_size() if dist.is_initialized() else 1
        everyone = [None] * world
        if world > 1:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        if not dist.is_initialized() or dist.get_rank() == 0:
            tokens = config.training.local_batch_size * config.training.seq_len
            Path(out).write_text(json.dumps({"ranks": everyone, "tokens_per_rank_step": tokens,
                                             "global_batch": config.training.global_batch_size}))
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------- orchestrator
def train_args(model: str, optimizer: str, steps: int, seq_len: int, local_batch: int, dump: str,
               offload: bool = False) -> list[str]:
    flavor = MODELS[model][0]
    recipe, name = (MUON_RECIPE, "Gefen") if optimizer == "GefenMuon" else (RECIPE, optimizer)
    return ["--job.config", str(ROOT / recipe), "--job.dump_folder", dump, "--model.flavor", flavor,
            "--optimizer.name", name, "--training.steps", str(steps), "--training.seq_len", str(seq_len),
            "--training.local_batch_size", str(local_batch), "--lr_scheduler.total_steps", str(steps),
            "--checkpoint.enable", "false", "--metrics.log_freq", "1",
            *(["--training.enable_cpu_offload"] if offload else [])]


def summarize(raw: dict, ranks: int) -> dict:
    """Per-step worst-rank times -> the table's figures."""
    per_rank = raw["ranks"]
    n = min(len(r["steps"]) for r in per_rank)
    steps = [max(r["steps"][i] for r in per_rank) for i in range(n)]
    opts = [max(r["opt_steps"][i] for r in per_rank) for i in range(min(len(r["opt_steps"]) for r in per_rank))]
    steady = steps[2:] or steps[1:] or steps
    steady_opt = opts[2:] or opts[1:] or opts
    step_s = statistics.median(steady)
    state = sum(r["state_bytes"] for r in per_rank)
    muon = {}
    if all(r.get("muon_steps") for r in per_rank):
        m = min(len(r["muon_steps"]) for r in per_rank)
        first = 2 if m > 2 else (1 if m > 1 else 0)

        def worst(key: str) -> float:  # the steady median of each step's worst rank
            return statistics.median(max(r["muon_steps"][i][key] for r in per_rank) for i in range(first, m))

        muon = {"ns_s": worst("ns_s"), "exchange_bytes": worst("sent") + worst("received"),
                "sent_bytes": worst("sent"), "inflight_peak": worst("peak"),
                "inflight_bound": max(r["muon_steps"][0]["bound"] for r in per_rank),
                "buckets": per_rank[0]["muon_steps"][0]["buckets"]}
    numel = sum(r["numel"] for r in per_rank)
    return {
        "steps": n, "first_step_s": steps[0], "steady_step_s": step_s, "steady_opt_s": statistics.median(steady_opt),
        "first_opt_s": opts[0] if opts else float("nan"), "steady_from_step": 3 if len(steps) > 2 else 2,
        "agreement_s": max(r.get("agreement_s", 0.0) for r in per_rank),
        "tokens_per_s": raw["tokens_per_rank_step"] * ranks / step_s,
        "peak_bytes": max(r["peak"] for r in per_rank), "memory": per_rank[0]["memory"],
        "opt_bytes_per_param": state / numel if numel else float("nan"),
        # the worst rank's state over the whole model's parameters (goal for a sharded state: ~1/ranks)
        "rank_bytes_per_param": max(r["state_bytes"] for r in per_rank) / numel if numel else float("nan"),
        "exact_bytes_per_param": per_rank[0].get("exact_bytes", 0) / numel if numel else float("nan"),
        "inflight_bytes_per_param": per_rank[0].get("inflight_bytes", 0) / numel if numel else float("nan"),
        "muon_share": per_rank[0].get("muon_numel", 0) / numel if numel else float("nan"),
        **muon,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--ranks", default="2", help="world size, or comma-separated world sizes (e.g. 2,4)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from {', '.join(CHOICES)}")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default per model: debug 10, 150M 4)")
    ap.add_argument("--seq-len", type=int, default=0, help="(default per model: debug 256, 150M 128)")
    ap.add_argument("--local-batch", type=int, default=0, help="(default per model: debug 4, 150M 2)")
    ap.add_argument("--offload", action="store_true",
                    help="train with --training.enable_cpu_offload (host-resident shards and optimizer step)")
    ap.add_argument("--json", default="", help="also write every figure here")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.worker:
        args.train_args = rest
        return args
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        ap.error(f"--models: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(MODELS)}")
    try:
        args.ranks = [int(r) for r in str(args.ranks).split(",") if r.strip()]
    except ValueError:
        ap.error(f"--ranks: integers, comma-separated, not {args.ranks!r}")
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    bad = [o for o in args.optimizers if o not in CHOICES]
    if bad or not args.optimizers:
        ap.error(f"--optimizers: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(CHOICES)}")
    if not args.ranks or min(args.ranks) < 1 or args.steps < 0 or args.seq_len < 0 or args.local_batch < 0:
        ap.error("--ranks must be >= 1 and --steps, --seq-len, --local-batch >= 0 (0: the model's default)")
    if 0 < args.steps < 2:
        ap.error("--steps must be >= 2: the first step is reported apart from the steady state")
    return args


def settings(args: argparse.Namespace, model: str) -> tuple[int, int, int]:
    _, steps, seq, batch = MODELS[model]
    return args.steps or steps, args.seq_len or seq, args.local_batch or batch


def run(args: argparse.Namespace) -> list[dict]:
    from gefen_titan.validation.runs import free_port

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            steps, seq, batch = settings(args, model)
            for ranks in args.ranks:
                for optimizer in args.optimizers:
                    dump = os.path.join(tmp, f"{model}-{ranks}-{optimizer}")
                    out = os.path.join(tmp, f"{model}-{ranks}-{optimizer}.json")
                    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                           f"--master-port={free_port()}", "-m", "benchmarks.training", "--worker", out,
                           *train_args(model, optimizer, steps, seq, batch, dump, args.offload)]
                    begin = time.monotonic()
                    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                    if proc.returncode:
                        sys.stderr.write((proc.stdout + proc.stderr)[-6000:])
                        raise SystemExit(f"training run failed: {model} {optimizer} at {ranks} ranks")
                    row = summarize(json.loads(Path(out).read_text()), ranks)
                    row.update(model=model, optimizer=optimizer, ranks=ranks, seq_len=seq, local_batch=batch,
                               wall_s=time.monotonic() - begin, offload=args.offload)
                    rows.append(row)
                    print(f"done: {model} {optimizer} at {ranks} ranks ({row['wall_s']:.0f} s)", file=sys.stderr,
                          flush=True)
    return rows


def _versus(name: str, g: dict, a: dict) -> str:
    return (f"{name}: tokens/s x{g['tokens_per_s'] / a['tokens_per_s']:.2f}, "
            f"first step x{g['first_step_s'] / a['first_step_s']:.2f}, steady step "
            f"x{g['steady_step_s'] / a['steady_step_s']:.2f}, optimizer step "
            f"x{g['steady_opt_s'] / a['steady_opt_s']:.2f}, peak memory "
            f"x{g['peak_bytes'] / a['peak_bytes']:.2f}, "
            f"state x{g['opt_bytes_per_param'] / a['opt_bytes_per_param']:.3f}")


def report(rows: list[dict]) -> str:
    lines = ["recipes/llama_gefen.toml (GefenMuon: recipes/llama_gefen_muon.toml) through torchtitan's Trainer"
             + (" with --training.enable_cpu_offload" if rows[0].get("offload") else "") + "; "
             "step times are the slowest rank's, steady = median from step 3; peak memory: "
             f"{rows[0]['memory']}, worst rank; opt B/param/rank: the worst rank's state over the model's "
             "parameters", "",
             "| model | ranks | steps x seq x local batch | optimizer | tokens/s (job) | first step s (agreement) "
             "| steady step s | optimizer step s (steady) | peak MiB/rank | opt B/param | opt B/param/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        agreed = f" ({r['agreement_s']:.2f})" if r.get("agreement_s") else ""
        lines.append(f"| {r['model']} | {r['ranks']} | {r['steps']} x {r['seq_len']} x {r['local_batch']} | "
                     f"{r['optimizer']} | {r['tokens_per_s']:,.0f} | {r['first_step_s']:.2f}{agreed} | "
                     f"{r['steady_step_s']:.2f} | {r['steady_opt_s']:.3f} | {r['peak_bytes'] / 2**20:,.0f} | "
                     f"{r['opt_bytes_per_param']:.3f} | {r['rank_bytes_per_param']:.4f} |")
    lines.append("")
    for model, ranks in dict.fromkeys((r["model"], r["ranks"]) for r in rows):
        by = {r["optimizer"]: r for r in rows if r["model"] == model and r["ranks"] == ranks}
        where = f"{model} at {ranks} ranks"
        if "Gefen" in by and "AdamW" in by:
            lines.append(_versus(f"{where}: Gefen vs AdamW", by["Gefen"], by["AdamW"]))
        m = by.get("GefenMuon")
        if m is None:
            continue
        for base in ("Gefen", "AdamW"):
            if base in by:
                lines.append(_versus(f"{where}: GefenMuon vs {base}", m, by[base]))
        lines.append(f"{where}: GefenMuon state per rank {m['rank_bytes_per_param']:.4f} B/param = "
                     f"{m['rank_bytes_per_param'] * ranks:.3f} / {ranks} of the model (goal <= 1.05 / {ranks}); "
                     f"gefen-x exact mode would keep {m['exact_bytes_per_param']:.4f} B/param on every rank "
                     f"for the GefenMuon matrices alone ({m['muon_share']:.1%} of the parameters; arithmetic, "
                     "the run's periods)")
        if "ns_s" in m:
            lines.append(f"{where}: GefenMuon optimizer step {m['steady_opt_s']:.3f} s, of it Newton-Schulz "
                         f"{m['ns_s']:.3f} s ({m['ns_s'] / m['steady_opt_s']:.0%}; the busiest rank's); exchange "
                         f"{m['exchange_bytes'] / 2**20:,.1f} MiB per rank and step (sent + received); in flight "
                         f"at most {m['inflight_peak'] / 2**20:,.1f} MiB per rank (bound "
                         f"{m['inflight_bound'] / 2**20:,.1f} MiB, {m['buckets']} bucket(s))")
    muon_rows = {(r["model"], r["ranks"]): r for r in rows if r["optimizer"] == "GefenMuon"}
    for (model, ranks), r in muon_rows.items():
        one = muon_rows.get((model, 1))
        if one is not None and ranks > 1:
            ratio = r["steady_opt_s"] / one["steady_opt_s"]
            lines.append(f"{model}: GefenMuon steady optimizer step at {ranks} ranks x{ratio:.2f}"
                         f" of 1 rank's ({r['steady_opt_s']:.2f} s vs {one['steady_opt_s']:.2f} s)"
                         + (f"; {ranks} ranks on {os.cpu_count()} cores are oversubscribed"
                            if ranks > (os.cpu_count() or 1) else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        from gefen_titan import patches
        from gefen_titan.recipe import flavors

        patches.apply_all()  # CPU / gloo training
        flavors.register_flavors()  # --model 150M
        return _worker(args.worker, args.train_args)
    rows = run(args)
    print("\n" + report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
