"""One-GPU check: everything gefen-titan does on CUDA, in one run, with one JSON report.

``scripts/gpu_check.sh`` runs this on a machine with one CUDA GPU (under 8
minutes on an H100/H200 class part). Stages, in order:

1. ``kernels``: ``tests/unit/test_quant_kernels.py`` on CUDA (the compiled Triton
   kernels against the torch reference, bit for bit); the CUDA test must
   run, not skip.
2. ``bandwidth``: the reshard kernels' throughput (``benchmarks.quant.
   measure``) at 64M, 256M and 1G elements, as a fraction of the device's
   memory bandwidth; target >= 70% at >= 64M elements on Hopper
   (compute capability 9.x).
3. ``train``: one-GPU training of the debug recipe with fused Gefen
   (``--optimizer.implementation fused``), NCCL, 10 steps; losses finite and
   the last below the first.
4. ``checkpoint``: the CPU half trains the debug recipe 3 steps at 2 CPU
   ranks (gloo, global batch 8), saves a checkpoint of step 2 in the current
   format and dumps the global state; the GPU half loads it on
   the GPU (1 rank, NCCL) and its state right after the load must equal the
   saved one bit for bit (``gefen_titan.validation.compare_global``).
5. ``muon``: GefenMuon's sharded step on the GPU: its momentum on two row
   shards of a matrix equals the whole matrix's, bit for bit, through gefen-x's
   fused CUDA momentum kernel, and the fused kernel equals gefen-x's
   pure-torch path on the same device (``muon_momentum_check``); then
   one-GPU training of ``recipes/llama_gefen_muon.toml`` (NCCL, fused), as
   ``train`` checks it (one rank: the sharded step orthogonalizes every
   matrix where it is). One GPU cannot run two NCCL ranks, so the
   owner-parallel exchange (packed ``batch_isend_irecv``) is checked on
   gloo by the test suite only; on NCCL it needs two GPUs or more
   (``gefen-titan validate --recipe recipes/llama_gefen_muon.toml
   --backend nccl``, ``scripts/bench_muon_exchange.py --backend nccl``).
6. ``factored``: Gefen's factored second moment on the GPU
   (``factored_check``). Its CUDA path is gefen-titan's own step
   (``optim/kinds/gefen/factored.py``: torch ops on any device), not
   gefen-x's fused factored kernel, whose row and column sums are unordered
   float atomics: the sums are int64 fixed point (``optim.axis_sums``,
   exact in any order), the rest per element or per block. Checked: the
   fixed-point sums of a matrix cut into uneven parts (as ranks would cut
   it) equal the whole's on the GPU, bit for bit; and a factored Gefen
   stepped on the GPU is compared with the same on the CPU (reported:
   ``cuda_equals_cpu``; a difference there is torch's CUDA rounding of an
   elementwise op, which is the same at every layout, so not a failure);
   then one-GPU training of the debug recipe with
   ``--optimizer.gefen.second_moment factored``, as ``train`` checks it.
7. ``converters``: torchtitan's float8 and mxfp8 model converters under Gefen:
   one-GPU training of the debug recipe with ``[[model.converters]] kind =
   "float8"``, then ``"mxfp8"`` (``converter_recipe``; NCCL, fused), each as
   ``train`` checks it. They need a GPU and torchao (float8: compute
   capability 8.9+; mxfp8: 10.0+, so on Hopper mxfp8 is reported skipped
   and the stage rests on float8).

Without CUDA only the CPU half of ``checkpoint``, the shard check of
``muon`` and the sums check of ``factored`` run (so they cannot rot before
a GPU runs them), every GPU stage is reported as skipped, and the exit
status is 3 with a line saying so. A stage that would start after
``--budget-s`` is not run: the report marks it ``"ok": null`` with
``"skipped": "not run: budget ..."``, and the run is not a pass, however the
other stages went (status ``incomplete``, exit 4): a check that did not run
proved nothing. ``verdict`` turns the stages' results into the status.

Exit status: 0 every stage ran and passed; 1 a check failed; 2 bad
arguments; 3 no CUDA; 4 a stage was not run (time budget).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("kernels", "bandwidth", "train", "checkpoint", "muon", "factored", "converters")
RECIPE = "recipes/llama_gefen.toml"
MUON_RECIPE = "recipes/llama_gefen_muon.toml"
BANDWIDTH_TARGET, BANDWIDTH_MIN_ELEMENTS = 0.70, 64 << 20
OK, FAILED, NO_CUDA, NOT_RUN = 0, 1, 3, 4
# The converters stage's kinds, in order, and the compute capability below
# which torchtitan's converter refuses to build (Float8LinearConverter: 8.9,
# MXFP8LinearConverter: 10.0).
CONVERTERS = {"float8": (8, 9), "mxfp8": (10, 0)}

__all__ = ["CONVERTERS", "FAILED", "NOT_RUN", "NO_CUDA", "OK", "STAGES", "converter_recipe", "main",
           "factored_check", "muon_momentum_check", "parse_args", "stage_converters", "verdict"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/gpu_check/report.json", help="the JSON report (default: %(default)s)")
    ap.add_argument("--work", default="outputs/gpu_check", help="folder for runs and logs (default: %(default)s)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {', '.join(STAGES)}")
    ap.add_argument("--sizes", default="64M,256M,1G", help="bandwidth sizes in elements (default: %(default)s)")
    ap.add_argument("--train-steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no stage after this many seconds")
    args = ap.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in args.stages if s not in STAGES]
    if bad or not args.stages:
        ap.error(f"--stages: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(STAGES)}")
    from benchmarks.quant import parse_size

    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes: expected sizes like 64M,1G, got {args.sizes!r}")
    if args.train_steps < 2 or args.budget_s <= 0:
        ap.error("--train-steps must be >= 2 and --budget-s > 0")
    return args


def _env() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "host": platform.node(), "cuda": torch.cuda.is_available(),
                            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                        timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["commit"] = ""
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                    memory_gib=props.total_memory / 2**30, cuda_version=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


# ----------------------------------------------------------------- stages
def stage_kernels(args, work: Path) -> dict[str, Any]:
    xml = work / "kernels.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "unit" / "test_quant_kernels.py"), f"--junitxml={xml}", f"--basetemp={work / 'pytest'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (work / "kernels.log").write_text(proc.stdout + proc.stderr)
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    cuda_cases = [c for c in suite.iter("testcase") if "cuda" in c.get("name", "")]
    cuda_ran = bool(cuda_cases) and not any(c.find("skipped") is not None for c in cuda_cases)
    ok = proc.returncode == 0 and counts["failures"] == 0 and counts["errors"] == 0 and cuda_ran
    why = "" if ok else ("the CUDA kernel tests were skipped" if not cuda_ran
                         else "kernel tests failed (see kernels.log)")
    return {"ok": ok, "why": why, **counts, "cuda_tests": len(cuda_cases), "cuda_tests_ran": cuda_ran}


def stage_bandwidth(args, work: Path) -> dict[str, Any]:
    import torch

    from benchmarks.quant import measure

    device = torch.device("cuda", 0)
    rows = measure(args.sizes, device, echo=False)
    props = torch.cuda.get_device_properties(0)
    hopper = props.major == 9
    checked = [r for r in rows if "of_peak" in r and r["elements"] >= BANDWIDTH_MIN_ELEMENTS]
    worst = min((r["of_peak"] for r in checked), default=None)
    ok = worst is not None and (worst >= BANDWIDTH_TARGET or not hopper)
    if worst is None:
        why = "no kernel figure at >= 64M elements (peak bandwidth unknown or sizes skipped)"
    elif not ok:
        low = min(checked, key=lambda r: r["of_peak"])
        why = (f"{low['op']} at {low['elements'] / 2**20:.0f}M elements reached {low['of_peak']:.0%} of "
               f"{low['peak']}, target {BANDWIDTH_TARGET:.0%}")
    else:
        why = "" if hopper else f"target applies to Hopper; this is compute capability {props.major}.{props.minor}"
    return {"ok": ok, "why": why, "worst_of_peak": worst, "target": BANDWIDTH_TARGET, "hopper": hopper, "rows": rows}


_STEP = re.compile(r"step:\s*(\d+)\s.*?loss:\s*([0-9.naninf]+)", re.I)
_TPS = re.compile(r"tps:\s*([0-9,]+)")
_MEM = re.compile(r"memory:\s*([0-9.]+)\s*GiB")


def stage_train(args, work: Path, recipe: str = RECIPE, name: str = "train", extra: tuple[str, ...] = ()
                ) -> dict[str, Any]:
    from gefen_titan.validation.runs import free_port

    folder = work / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master-port={free_port()}",
           "-m", "gefen_titan.train", "--job.config", str(ROOT / recipe), "--job.dump_folder", str(folder),
           "--optimizer.implementation", "fused", "--training.steps", str(args.train_steps),
           "--checkpoint.enable", "false", "--metrics.log_freq", "1", *extra]
    begin = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.monotonic() - begin
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    (work / f"{name}.log").write_text(log)
    losses: dict[int, float] = {}
    tps, mem = [], []
    for line in log.splitlines():
        m = _STEP.search(line)
        if m:
            losses.setdefault(int(m.group(1)), float(m.group(2)))
            t, g = _TPS.search(line), _MEM.search(line)
            if t:
                tps.append(int(t.group(1).replace(",", "")))
            if g:
                mem.append(float(g.group(1)))
    nccl = bool(re.search(r"nccl", log, re.I))
    steps = sorted(losses)
    finite = all(math.isfinite(v) for v in losses.values())
    ok = (proc.returncode == 0 and len(steps) == args.train_steps and finite
          and losses[steps[-1]] < losses[steps[0]])
    why = "" if ok else (f"exit {proc.returncode}" if proc.returncode else
                         f"{len(steps)} of {args.train_steps} steps logged, losses {losses}")
    return {"ok": ok, "why": why, "seconds": seconds, "losses": losses, "tps_after_first": tps[1:],
            "memory_gib": max(mem, default=None), "nccl_in_log": nccl}


def stage_checkpoint(args, work: Path, cuda: bool) -> dict[str, Any]:
    from gefen_titan.validation.compare_global import compare_global_state
    from gefen_titan.validation.runs import Settings, reference_run, resume_run

    settings = Settings(recipe=str(ROOT / RECIPE), steps_before=2, steps_after=1, global_batch=8, backend="gloo")
    folder = work / "checkpoint"
    begin = time.monotonic()
    ref = reference_run(settings, 2, out=folder, quiet=True)
    saved = ref.dumps("save", settings.steps_before)
    step_dir = Path(ref.folder, "checkpoint", f"step-{settings.steps_before}")
    cpu = {"ok": bool(saved) and step_dir.is_dir(), "seconds": time.monotonic() - begin, "checkpoint": str(step_dir),
           "losses": ref.losses, "entries": len(saved[0]["state"]) if saved else 0}
    out: dict[str, Any] = {"cpu_half": cpu}
    if not cpu["ok"]:
        out.update(ok=False, why="the CPU half wrote no checkpoint or no state dump")
        return out
    if not cuda:
        out.update(ok=True, gpu_half="skipped: no CUDA", why="")
        return out
    begin = time.monotonic()
    gpu_settings = dataclasses.replace(settings, backend="nccl")
    res = resume_run(gpu_settings, ref, 1, folder / "gpu-resume")
    loaded = res.dumps("load", settings.steps_before)
    cmp = compare_global_state(saved, loaded) if loaded else {"exact": False, "problems": ["no load dump"]}
    out["gpu_half"] = {"seconds": time.monotonic() - begin, "exact": cmp["exact"], "problems": cmp["problems"],
                       "entries": cmp.get("entries"), "losses_after": res.losses}
    out.update(ok=bool(cmp["exact"]), why="" if cmp["exact"] else "; ".join(cmp["problems"]))
    return out


def muon_momentum_check(device: str, fused: bool, rows: int = 1027, cols: int = 768, steps: int = 3
                        ) -> dict[str, Any]:
    """GefenMuon's momentum on two row shards against the whole matrix (and,
    with ``fused``, gefen-x's fused CUDA kernel against its pure-torch path):
    ``steps`` steps of the same gradients, codes, magnitudes and the dense
    momentum compared bit for bit. Runs on CPU too (``fused`` False), so the
    check itself is tested without a GPU."""
    import torch

    from gefen_titan.optim import gefenx as gx

    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(rows, cols, generator=gen) ** 3).to(device) for _ in range(steps)]
    cut = rows // 2 + 1  # uneven, as FSDP cuts an odd row count
    codebook = torch.sort(torch.linspace(-1, 1, gx.K) ** 3).values.to(device)

    def run(fused_kernel: bool, pieces: list[tuple[int, int]]) -> list[tuple[torch.Tensor, ...]]:
        params = [torch.nn.Parameter(torch.zeros(b - a, cols, device=device)) for a, b in pieces]
        optim = gx.new_gefen_muon([{"params": [(f"w{i}", p) for i, p in enumerate(params)]}], fused=fused_kernel)
        for p in params:
            gx.set_period(optim, p, 256)
        gx.set_codebook(optim, codebook.clone())
        group = optim.param_groups[0]
        out = []
        for g in grads:
            dense = [gx.muon_momentum(optim, f"w{i}", p, group, g[a:b].clone())
                     for i, (p, (a, b)) in enumerate(zip(params, pieces))]
            states = [gx.muon_read(optim, p) for p in params]
            out.append((torch.cat(dense), torch.cat([st.codes.reshape(-1) for st in states]),
                        torch.cat([st.magnitude.reshape(-1) for st in states])))
        return out

    def equal(a, b) -> bool:
        return all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))

    whole = run(fused, [(0, rows)])
    result: dict[str, Any] = {"device": device, "fused": fused, "shape": [rows, cols], "cut": cut,
                              "shards_equal_whole": equal(whole, run(fused, [(0, cut), (cut, rows)]))}
    if fused:
        result["fused_equals_torch"] = equal(whole, run(False, [(0, rows)]))
    result["ok"] = result["shards_equal_whole"] and result.get("fused_equals_torch", True)
    result["why"] = "" if result["ok"] else "momentum differs: " + ", ".join(
        k for k in ("shards_equal_whole", "fused_equals_torch") if result.get(k) is False)
    return result


def stage_muon(args, work: Path, cuda: bool) -> dict[str, Any]:
    if not cuda:
        out = {"cpu": muon_momentum_check("cpu", fused=False)}
        out.update(ok=out["cpu"]["ok"], why=out["cpu"]["why"], gpu_half="skipped: no CUDA")
        return out
    out = {"momentum": muon_momentum_check("cuda", fused=True)}
    out["train"] = stage_train(args, work, MUON_RECIPE, "muon_train")
    out["ok"] = bool(out["momentum"]["ok"] and out["train"]["ok"])
    out["why"] = "; ".join(w for w in (out["momentum"]["why"], out["train"]["why"]) if w)
    return out


def factored_check(device: str, rows: int = 1027, cols: int = 768, steps: int = 3) -> dict[str, Any]:
    """Gefen's factored second moment on ``device``: the exact row and column sums of grad² over uneven
    parts equal the whole's (the layout invariance of its cross-rank sums), and ``steps`` factored steps of
    one matrix there against the CPU's (parameters, codes, magnitudes, rows and columns). Runs on CPU too
    (then the second comparison is the CPU against itself), so the check is tested without a GPU."""
    import torch

    from gefen_titan.optim import axis_sums
    from gefen_titan.optim import gefenx as gx
    from gefen_titan.optim.container import GefenOptimizersContainer
    from gefen_titan.optim.kinds.gefen.options import GefenOptions

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(rows, cols, generator=gen) ** 3 * 1e-2 for _ in range(steps)]
    x = grads[0].to(device).float().square()
    same = True
    for dim in (0, 1):
        whole = axis_sums.exponents(x, dim)
        total = axis_sums.sums(x, dim, whole, x.shape[dim])
        cuts = [x.shape[dim] // 3, x.shape[dim] // 3 + 1, 2 * x.shape[dim] // 3 + 5]  # an empty part too
        parts = torch.tensor_split(x, cuts, dim=dim)
        codes = torch.stack([axis_sums.exponents(p, dim) for p in parts]).amax(dim=0)
        split = sum(axis_sums.sums(p, dim, codes, x.shape[dim]) for p in parts)
        same = same and torch.equal(codes, whole) and torch.equal(split, total)
    codebook = torch.sort(torch.linspace(-1, 1, gx.K) ** 3).values

    def run(dev: str) -> list[torch.Tensor]:
        w = torch.nn.Parameter(torch.zeros(rows, cols, device=dev))
        model = torch.nn.Module()
        model.w = w
        opt = GefenOptimizersContainer.Config(name="Gefen", lr=1e-2, gefen=GefenOptions(
            second_moment="factored", cpu_step="gefen-x")).build(model_parts=[model])
        opt.agreement = None  # the codebook and period set here, as the agreement would
        (optim,) = opt.optimizers_of("Gefen")
        gx.set_codebook(optim, codebook.to(dev))
        gx.set_period(optim, w, 256)
        for g in grads:
            w.grad = g.to(dev)
            optim.step()
        st = gx.gefen_read(optim, w)
        return [t.detach().cpu() for t in (w, st.codes, st.magnitude, st.v_row, st.v_col)]

    here, cpu = run(device), run("cpu")
    result = {"device": device, "shape": [rows, cols], "sums_split_equal_whole": bool(same),
              "cuda_equals_cpu": all(torch.equal(a, b) for a, b in zip(here, cpu)),
              "finite": all(bool(torch.isfinite(t.float()).all()) for t in here)}
    result["ok"] = result["sums_split_equal_whole"] and result["finite"]
    result["why"] = "" if result["ok"] else "factored: " + ", ".join(
        k for k in ("sums_split_equal_whole", "finite") if not result[k])
    return result


def stage_factored(args, work: Path, cuda: bool) -> dict[str, Any]:
    if not cuda:
        out = {"cpu": factored_check("cpu")}
        out.update(ok=out["cpu"]["ok"], why=out["cpu"]["why"], gpu_half="skipped: no CUDA")
        return out
    out = {"check": factored_check("cuda")}
    out["train"] = stage_train(args, work, RECIPE, "factored_train", ("--optimizer.gefen.second_moment", "factored"))
    out["ok"] = bool(out["check"]["ok"] and out["train"]["ok"])
    out["why"] = "; ".join(w for w in (out["check"]["why"], out["train"]["why"]) if w)
    return out


def converter_recipe(work: Path, kind: str) -> Path:
    """The debug recipe with one model converter (``[[model.converters]]``), written under ``work``."""
    path = work / f"llama_gefen_{kind}.toml"
    path.write_text(f'[job]\nextends = "{ROOT / RECIPE}"\n\n[[model.converters]]\nkind = "{kind}"\n')
    return path


def stage_converters(args, work: Path) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    out: dict[str, Any] = {}
    for kind, need in CONVERTERS.items():
        if (props.major, props.minor) < need:
            out[kind] = {"ok": None, "skipped": f"needs compute capability {need[0]}.{need[1]}+, "
                                                f"this is {props.major}.{props.minor}"}
            continue
        out[kind] = stage_train(args, work, str(converter_recipe(work, kind)), f"{kind}_train")
        if not out[kind]["ok"] and "torchao is not installed" in (work / f"{kind}_train.log").read_text():
            out[kind]["why"] = "torchao is not installed (the converters need it: pip install torchao)"
    ran = {k: out[k] for k in CONVERTERS if out[k]["ok"] is not None}
    out["ok"] = bool(ran) and all(r["ok"] for r in ran.values())
    out["why"] = "; ".join(f"{k}: {r['why']}" for k, r in ran.items() if not r["ok"]) or (
        "" if ran else "no converter can run on this GPU")
    return out


# ------------------------------------------------------------------- main
def verdict(stages: dict[str, dict[str, Any]], cuda: bool) -> tuple[str, int]:
    """(status, exit code) of a run from its stages' results.

    A stage's ``ok`` is True (passed), False (failed) or None (not run: no
    CUDA, or the time budget). Any failure fails the run; without CUDA the
    run is ``no_cuda``; with CUDA, a stage that did not run makes the run
    ``incomplete``, never ``ok``: only a run whose every stage ran and passed is.
    """
    if any(r.get("ok") is False for r in stages.values()):
        return "failed", FAILED
    if not cuda:
        return "no_cuda", NO_CUDA
    if not stages or any(r.get("ok") is not True for r in stages.values()):
        return "incomplete", NOT_RUN
    return "ok", OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    work = (ROOT / args.work) if not Path(args.work).is_absolute() else Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {"env": _env(), "stages": {}, "budget_s": args.budget_s}
    begin = time.monotonic()
    for name in args.stages:
        elapsed = time.monotonic() - begin
        if elapsed > args.budget_s:
            why = f"not run: budget: {elapsed:.0f} s elapsed of {args.budget_s:.0f}"
            report["stages"][name] = {"ok": None, "skipped": why}
            print(f"gpu_check: {name}: NOT RUN ({why.removeprefix('not run: ')})", flush=True)
            continue
        if not cuda and name not in ("checkpoint", "muon", "factored"):
            report["stages"][name] = {"ok": None, "skipped": "no CUDA"}
            continue
        print(f"gpu_check: {name} ...", flush=True)
        t0 = time.monotonic()
        try:
            if name in ("checkpoint", "muon", "factored"):
                result = globals()[f"stage_{name}"](args, work, cuda)
            else:
                result = globals()[f"stage_{name}"](args, work)
        except Exception as e:  # a broken stage is a failed check with its reason, the others still run
            result = {"ok": False, "why": f"{type(e).__name__}: {e}"}
        result["wall_s"] = time.monotonic() - t0
        report["stages"][name] = result
        print(f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED: ' + str(result.get('why'))} "
              f"({result['wall_s']:.0f} s)", flush=True)
    report["wall_s"] = time.monotonic() - begin
    report["status"], code = verdict(report["stages"], cuda)
    out.write_text(json.dumps(report, indent=1, default=str))
    if code == FAILED:
        failed = [n for n, r in report["stages"].items() if r.get("ok") is False]
        print(f"gpu_check: FAILED: {', '.join(failed)}; report {out}")
    elif code == NO_CUDA:
        print(f"gpu_check: no CUDA device (torch.cuda.is_available() is False): ran the CPU halves of the checkpoint "
              f"and muon checks only, the GPU stages were skipped; report {out}")
    elif code == NOT_RUN:
        not_run = [n for n, r in report["stages"].items() if r.get("ok") is not True]
        print(f"gpu_check: NOT A PASS: {', '.join(not_run)} not run within --budget-s {args.budget_s:.0f}; "
              f"report {out}")
    else:
        print(f"gpu_check: ok in {report['wall_s']:.0f} s; report {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
