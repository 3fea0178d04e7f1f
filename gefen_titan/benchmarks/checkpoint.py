"""Benchmark optimizer checkpoints: gefen-titan (v2 and v1) vs gefen-x GefenDCPState vs AdamW.

One model (torchtitan's Llama 3 debug model: its real parameters under FSDP2,
6.16M elements), one run: for each method, train 3 steps at --save-ranks and
save; then load at each of --load-ranks and take one more step. Gradients are
synthetic but deterministic per step and global (each rank takes its shard),
so every world size sees the same update and the first update after a load
can be compared with the uninterrupted run's. Weights are saved beside the
optimizer and loaded before it, untimed: the figures are the optimizer's.

Prints, per method: optimizer bytes/param on disk and on disk over in
memory, the first step's time (gefen-titan v1 and GefenDCPState run gefen-x's
own per-rank period search and numba codebook solver; v2 agrees them across
ranks with the fast solver), save time, load time per target world size, peak
RSS growth during the load, and the first-update relative L2 error vs the
uninterrupted run (overall, and the worst parameter).

    python scripts/bench_checkpoint.py                   # save at 2, load at 2, 4, 1
    python scripts/bench_checkpoint.py --save-ranks 4 --load-ranks 4,2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

METHODS = ("gefen-titan v2 (agreed)", "gefen-titan v1 (per-rank)", "gefen-x GefenDCPState", "AdamW")
SAVE_STEP = 3


# --------------------------------------------------------------------- worker
def _worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from gefen_titan import patches

    patches.apply_all()  # CPU / gloo FSDP2
    from gefen_titan.optimizer import GefenOptimizersContainer
    from torchtitan.models.llama3 import model_registry

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = model_registry("debugmodel", attn_backend="flex").model.build()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    names = [n for n, _ in model.named_parameters()]
    opt = GefenOptimizersContainer.Config(
        name="AdamW" if args.method == "AdamW" else "Gefen", lr=1e-3, implementation="for-loop",
        blocking="agreed" if "agreed" in args.method else "per_rank",
    ).build(model_parts=[model])

    def set_grads(step):
        for i, (name, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(step * 1000 + i)
            full = torch.randn(p.shape, generator=g)
            full *= torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=g) * 2 + 0.1
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            local = full[offset[0] : offset[0] + shape[0]].clone()
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    def full_params():
        return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}

    def next_update():
        """Step SAVE_STEP + 1: the weights before it and the update it made."""
        before = full_params()
        set_grads(SAVE_STEP + 1)
        opt.step()
        after = full_params()
        return {"before": before, "update": {n: after[n] - before[n] for n in names}}

    def state_obj():
        if args.method == "gefen-x GefenDCPState":
            from gefen import GefenDCPState

            return GefenDCPState(opt.optimizers[0])
        return opt

    result = {}
    if args.mode == "save":
        for step in range(1, SAVE_STEP + 1):
            set_grads(step)
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            if step == 1:
                result["first_step_s"] = time.perf_counter() - t0
            opt.zero_grad()
        state_bytes, numel = opt.state_bytes()
        totals = torch.tensor([state_bytes, numel], dtype=torch.float64)
        dist.all_reduce(totals)
        result["memory_bytes"] = float(totals[0])
        dist.barrier()
        t0 = time.perf_counter()
        kwargs = {}
        if args.method == "gefen-x GefenDCPState":
            from gefen import GefenSavePlanner

            kwargs["planner"] = GefenSavePlanner()
        dcp.save({"optimizer": state_obj(), "model": dict(model.named_parameters())}, checkpoint_id=args.ckpt, **kwargs)
        dist.barrier()
        result["save_s"] = time.perf_counter() - t0
        result.update(next_update())
    else:
        # Weights first and untimed: the figures are the optimizer's alone.
        # The live parameters (model.state_dict() splits the fused wqkv).
        dcp.load({"model": dict(model.named_parameters())}, checkpoint_id=args.ckpt)
        dist.barrier()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        if args.method.startswith("gefen-titan"):
            from torch.distributed.checkpoint import FileSystemReader

            opt.prepare_load(args.ckpt, FileSystemReader(args.ckpt).read_metadata(), prefix="optimizer.")
            try:
                dcp.load({"optimizer": opt}, checkpoint_id=args.ckpt)
            finally:
                opt.abort_load()
        else:
            dcp.load({"optimizer": state_obj()}, checkpoint_id=args.ckpt)
        dist.barrier()
        result["load_s"] = time.perf_counter() - t0
        result["peak_rss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        result.update(next_update())
        state_bytes, numel = opt.state_bytes()
        result["state_bytes_per_param"] = state_bytes / numel
    result["numel"] = sum(p.numel() for p in model.parameters())
    peaks = [None] * world
    dist.all_gather_object(peaks, result.get("peak_rss_mib"))
    if rank == 0:
        if result.get("peak_rss_mib") is not None:
            result["peak_rss_mib"] = max(peaks)
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- orchestrator
def _launch(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master-port=29655", "-m", "gefen_titan.benchmarks.checkpoint", "--worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"worker failed: {' '.join(args)}")


def _disk_bytes(ckpt: str) -> int:
    """Bytes the optimizer's entries take in the checkpoint files."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ckpt).read_metadata()
    return sum(info.length for index, info in md.storage_data.items() if index.fqn.startswith("optimizer"))


def _rel(a: dict, b: dict) -> tuple[float, float]:
    num = math.sqrt(sum(float(((a[n] - b[n]) ** 2).sum()) for n in b))
    den = math.sqrt(sum(float((b[n] ** 2).sum()) for n in b))
    worst = max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in b)
    return num / den, worst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save-ranks", type=int, default=2)
    ap.add_argument("--load-ranks", default="2,4,1")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    import torch

    loads = [int(x) for x in args.load_ranks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            tag = method.split()[-1].strip("()")
            ckpt = os.path.join(tmp, tag)
            out = os.path.join(tmp, f"{tag}-save.pt")
            _launch(args.save_ranks, "--mode", "save", "--method", method, "--ckpt", ckpt, "--out", out)
            saved = torch.load(out, weights_only=False)
            disk = _disk_bytes(ckpt)
            row = {"method": method, "bpp_disk": disk / saved["numel"], "disk_over_memory": disk / saved["memory_bytes"],
                   "first_step_s": saved["first_step_s"], "save_s": saved["save_s"], "loads": {}}
            for m in loads:
                out = os.path.join(tmp, f"{tag}-load{m}.pt")
                _launch(m, "--mode", "load", "--method", method, "--ckpt", ckpt, "--out", out)
                loaded = torch.load(out, weights_only=False)
                # The comparison is only meaningful if the weights came back whole.
                assert all(torch.equal(loaded["before"][k], saved["before"][k]) for k in saved["before"]), method
                err, worst = _rel(loaded["update"], saved["update"])
                row["loads"][m] = {"load_s": loaded["load_s"], "peak_rss_mib": loaded["peak_rss_mib"],
                                   "err": err, "worst": worst, "state_bpp": loaded["state_bytes_per_param"]}
            rows.append(row)
            print(f"done: {method}", file=sys.stderr)
    n = args.save_ranks
    print(f"\nLlama 3 debug model ({saved['numel'] / 1e6:.2f}M params), optimizer state saved at {n} ranks, "
          f"loaded at {', '.join(map(str, loads))} (gloo, CPU)\n")
    head = "| method | on disk B/param | disk / memory | first step s | save s |" + "".join(
        f" load {n}->{m} s | peak RSS MiB | 1st-update err (worst param) | state B/param |" for m in loads)
    print(head)
    print("|" + "---|" * (5 + 4 * len(loads)))
    for row in rows:
        cells = [row["method"], f"{row['bpp_disk']:.3f}", f"{row['disk_over_memory']:.4f}",
                 f"{row['first_step_s']:.2f}", f"{row['save_s']:.2f}"]
        for m in loads:
            ld = row["loads"][m]
            cells += [f"{ld['load_s']:.2f}", f"{ld['peak_rss_mib']:.0f}", f"{ld['err']:.2e} ({ld['worst']:.2e})", f"{ld['state_bpp']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    adamw = rows[-1]
    for ours in rows[:2]:
        print(f"\n{ours['method']}, ratios vs AdamW in this run: save x%.2f; " % (ours["save_s"] / adamw["save_s"]) + "; ".join(
            f"load {n}->{m} x{ours['loads'][m]['load_s'] / adamw['loads'][m]['load_s']:.2f}" for m in loads))
    print(f"first step: v2 {rows[0]['first_step_s']:.2f} s vs v1 {rows[1]['first_step_s']:.2f} s "
          f"(x{rows[1]['first_step_s'] / rows[0]['first_step_s']:.1f} faster)")
    print(json.dumps({"rows": rows}, default=float), file=open(os.environ.get("BENCH_JSON", os.devnull), "w"))


if __name__ == "__main__":
    main()
