"""Gefen's optimizer step on the CPU kernel against torch's AdamW, in one process (issue 37's figures).

    python scripts/bench_cpu_step.py                          # 6M and 50M, 1 and 2 threads
    python scripts/bench_cpu_step.py --models 6M --threads 1 --rounds 12
    python scripts/bench_cpu_step.py --gefen-x                # also gefen-x's own CPU path (~100x: slow)
    python scripts/bench_cpu_step.py --isa portable           # the portable build (no intrinsics), forced

The report's first line names the build the kernel runs (``avx2`` or
``portable``) and the torch roundings it follows; where the kernel cannot run
here, it says why, and the Gefen row is labelled as gefen-x's own path.

For each model and thread count (``torch.set_num_threads``), one process
builds the same fp32 parameters and gradients for every optimizer and times
their steps *interleaved* (round r steps each optimizer once, in turn), so a
change of machine load hits all of them alike; the figure is the median over
the rounds after the first two, and each ratio is against torch's fused
AdamW (``fused=True``) of the same run. Optimizers: Gefen on the kernel
(``optim.cpu_step``), torch's fused and foreach AdamW, and with ``--gefen-x``
Gefen on gefen-x's own path. Gefen's codebook and block periods are set
before its first step as the agreement sets them (a sorted 256-entry
codebook; a matrix's row length, 1 for vectors), and its first step (gefen-x
allocating the state) is not timed.

Models: the parameter shapes of a Llama. ``6M``: the debug model's (dim 256,
6 layers, FFN 768, vocab 2048: 6.16M); ``50M``: dim 512, 12 layers, FFN 1536,
vocab 8192 (49.3M).

Beside them: the machine's copy bandwidth (``dst.copy_(src)`` of 256 MiB,
same threads; 12 B per element: the read, the write, and the read a store
to memory not in cache makes first, which in-place optimizer steps do not
pay) and the byte floor, the
bytes a step must move at least: Gefen reads the gradient (4 B), its code
(1 B) and the parameter (4 B) and writes code and parameter (5 B): 14 B per
parameter; AdamW reads parameter, gradient and two moments (16 B) and writes
three (12 B): 28 B. The floor's time is those bytes at the copy bandwidth.

And the kernel's first-call cost, each in a fresh process: compiling it into
an empty cache folder, then loading it from that cache (with the self-check
against gefen-x that every process runs once), and building one codebook's
table (once per codebook and dtype).
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

import torch

MODELS = {"6M": (256, 6, 768, 2048), "50M": (512, 12, 1536, 8192)}
FLOOR_BYTES = {"Gefen": 14, "AdamW": 28}


def shapes(dim: int, layers: int, ffn: int, vocab: int) -> list[tuple[int, ...]]:
    out = [(vocab, dim)]
    for _ in range(layers):
        out += [(dim, dim)] * 4 + [(ffn, dim), (dim, ffn), (ffn, dim), (dim,), (dim,)]
    return out + [(dim,), (vocab, dim)]


def kernel_line() -> tuple[str, bool]:
    """What the kernel is in this process (build, roundings) or why it cannot run; and whether it runs."""
    from gefen_titan.optim import cpu_step
    from gefen_titan.optim.cpu_step import build

    lib = cpu_step.kernel()
    if isinstance(lib, build.Unavailable):
        return f"kernel: unavailable here ({lib.reason}); the Gefen row is gefen-x's own path", False
    return (f"kernel: {lib.isa} build, torch's sum order {lib.sum_width} lanes (fp64 {lib.sum_width_f64}), "
            f"{'fused' if lib.fused else 'unfused'} lerp; torch's CPU kernels: "
            f"{torch.backends.cpu.get_cpu_capability()}", True)


def _gefen(params: list[torch.nn.Parameter], kernel: bool) -> torch.optim.Optimizer:
    from gefen_titan.optim import cpu_step
    from gefen_titan.optim import gefenx as gx

    optim = gx.new_gefen([{"params": [(f"p{i}", p) for i, p in enumerate(params)], "lr": 1e-3,
                           "betas": (0.9, 0.95), "weight_decay": 0.1}], fused=False, factored_v_2d=False)
    gen = torch.Generator().manual_seed(1)
    codebook = torch.sort((torch.randn(256, generator=gen) * 0.25).clamp(-1, 1)).values
    codebook[0], codebook[-1] = -1.0, 1.0
    gx.set_codebook(optim, codebook)
    for p in params:
        gx.set_period(optim, p, p.shape[-1] if p.dim() == 2 else 1)
    cpu_step.install(optim, "kernel" if kernel else "gefen-x", "Gefen")
    return optim


def build_optimizers(model: str, with_gefen_x: bool, kernel_runs: bool = True
                     ) -> dict[str, tuple[torch.optim.Optimizer, list]]:
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(*s, generator=gen) * 0.02 for s in shapes(*MODELS[model])]
    grads = [torch.randn(*s, generator=gen) * 1e-3 for s in shapes(*MODELS[model])]
    out = {}
    makers = {"Gefen (kernel)" if kernel_runs else "Gefen (gefen-x: no kernel)": lambda ps: _gefen(ps, True),
              "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
              "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True)}
    if with_gefen_x:
        makers["Gefen (gefen-x)"] = lambda ps: _gefen(ps, False)
    for name, make in makers.items():
        params = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optim = make(params)
        optim.step()  # Gefen: gefen-x allocates the state; AdamW: its moments
        out[name] = (optim, params)
    return out


def copy_gbps(threads: int, mib: int = 256, repeat: int = 7) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 3 * src.numel() * 4 / statistics.median(times) / 1e9  # read, write-allocate read, write


def measure(model: str, threads: int, rounds: int, with_gefen_x: bool, kernel_runs: bool = True) -> dict:
    torch.set_num_threads(threads)
    optims = build_optimizers(model, with_gefen_x, kernel_runs)
    numel = sum(p.numel() for p in next(iter(optims.values()))[1])
    times: dict[str, list[float]] = {name: [] for name in optims}
    for _ in range(rounds):
        for name, (optim, _) in optims.items():
            t = time.perf_counter()
            optim.step()
            times[name].append(time.perf_counter() - t)
    median = {name: statistics.median(ts[2:] if len(ts) > 2 else ts) for name, ts in times.items()}
    gbps = copy_gbps(threads)
    return {"model": model, "params": numel, "threads": threads, "rounds": rounds, "step_s": median,
            "copy_gbps": gbps, "floor_s": {k: b * numel / (gbps * 1e9) for k, b in FLOOR_BYTES.items()}}


def first_call() -> dict:
    """Compile (empty cache) and load (cached, with the self-check) in fresh processes, and one table."""
    code = ("import time, json, torch; t = time.perf_counter(); from gefen_titan.optim import cpu_step; "
            "from gefen_titan.optim.cpu_step import build; lib = cpu_step.kernel(); "
            "print(json.dumps({'reason': lib.reason} if isinstance(lib, build.Unavailable) else "
            "{'wall_s': time.perf_counter() - t, 'built_s': lib.built_s, 'loaded_s': lib.loaded_s}))")
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "GEFEN_TITAN_CPU_STEP_CACHE": cache}
        for what in ("compile", "load"):
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode:
                raise SystemExit(f"the kernel's first-call child failed:\n{proc.stderr[-3000:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            if "reason" in got:
                return {"unavailable": got["reason"]}
            out[what] = got
    from gefen_titan.optim.cpu_step import codebook

    cb = torch.sort(torch.randn(256)).values.clamp(-1, 1)
    t = time.perf_counter()
    codebook.table_for(cb, torch.float32)
    out["table_s"] = time.perf_counter() - t
    return out


def report(rows: list[dict], first: dict | None, kernel: str = "") -> str:
    lines = [kernel] if kernel else []
    lines += ["One process, fp32, interleaved rounds, median step after the first two; x = / fused AdamW "
             "of the run", "", "| model | threads | optimizer | step ms | x fused AdamW |", "|---|---|---|---|---|"]
    for r in rows:
        fused = r["step_s"]["AdamW fused"]
        for name, s in r["step_s"].items():
            lines.append(f"| {r['model']} ({r['params'] / 1e6:.2f}M) | {r['threads']} | {name} | {s * 1e3:.1f} | "
                         f"{s / fused:.2f} |")
    lines += ["", "| model | threads | copy GB/s | floor Gefen ms (14 B/param) | floor AdamW ms (28 B/param) | "
              "Gefen kernel / its floor | fused AdamW / its floor |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["floor_s"]
        gefen = next(s for name, s in r["step_s"].items() if name.startswith("Gefen (kernel") or "no kernel" in name)
        lines.append(f"| {r['model']} | {r['threads']} | {r['copy_gbps']:.1f} | {f['Gefen'] * 1e3:.1f} | "
                     f"{f['AdamW'] * 1e3:.1f} | {gefen / f['Gefen']:.1f} | "
                     f"{r['step_s']['AdamW fused'] / f['AdamW']:.1f} |")
    if first and "unavailable" in first:
        lines += ["", f"first call: the kernel is unavailable here: {first['unavailable']}"]
    elif first:
        lines += ["", f"first call: compile {first['compile']['built_s']:.1f} s (process start to ready "
                  f"{first['compile']['wall_s']:.1f} s); load from the cache and self-check "
                  f"{first['load']['wall_s']:.2f} s (load {first['load']['loaded_s'] * 1e3:.0f} ms); one codebook's "
                  f"table {first['table_s'] * 1e3:.0f} ms"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (the first two are not counted)")
    ap.add_argument("--gefen-x", action="store_true", help="also time Gefen on gefen-x's own CPU path")
    ap.add_argument("--no-first-call", action="store_true", help="skip the compile / load timing")
    ap.add_argument("--json", default="", help="also write every figure here")
    ap.add_argument("--isa", choices=["avx2", "portable"], default=None,
                    help="force the kernel's build (GEFEN_TITAN_CPU_STEP_ISA); default: the host's")
    args = ap.parse_args(argv)
    if args.isa:
        os.environ["GEFEN_TITAN_CPU_STEP_ISA"] = args.isa
    models = [m for m in args.models.split(",") if m]
    if any(m not in MODELS for m in models) or args.rounds < 3:
        ap.error(f"--models from {', '.join(MODELS)}; --rounds >= 3")
    first = None if args.no_first_call else first_call()
    kernel, runs = kernel_line()
    print(kernel, flush=True)
    rows = [measure(m, int(t), args.rounds, args.gefen_x, runs) for m in models for t in args.threads.split(",")]
    print(report(rows, first))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "first_call": first}, f, indent=1)
