"""Benchmark optimizer checkpoints: gefen-titan vs gefen-x GefenDCPState vs AdamW.

One model (``--model``: torchtitan's Llama 3 debug model, 6.16M parameters,
or gefen_titan's ``150M`` flavor, 161.5M, where bytes dominate the fixed
costs; real parameters under FSDP2), one run: for each method, train
``--steps`` steps at ``--save-ranks`` and save; then load at each of
``--load-ranks`` and take one more step. Gradients are synthetic but
deterministic per step and global (each rank takes its shard), so every
world size sees the same update and the first update after a load can be
compared with the uninterrupted run's. Weights are saved in a checkpoint of
their own and loaded before the optimizer, untimed: the figures are the
optimizer's.

Methods (``--methods``): ``current`` is gefen-titan with the optimizer's
default blocking, i.e. the checkpoint format a run writes today (its label
names the version); ``v1`` the per-rank format (``blocking = "per_rank"``);
``gefen-x`` gefen-x's own ``GefenDCPState``; ``adamw`` the baseline;
``gefen-muon`` (not in the default list) the current format with GefenMuon
for the hidden matrices and Gefen for the rest, the param groups of
``recipes/llama_gefen_muon.toml``. ``current``, ``v1`` and ``gefen-muon`` are
saved and loaded as ``GefenCheckpointManager`` does it (``checkpoint.io.storage``'s
writer: v3's raw entries and ``.digests``; its checking reader, which checks
every item on every rank before the first commit); ``gefen-x`` and ``adamw``
with DCP's own writer and reader, as torchtitan saves them. ``digests`` (not
in the default list) is ``current`` plus a line with the digests' cost on
its own: its workers also save and load the same state without and with
digests (the same writer and reader, ``storage_writer(digests=False)``),
``--paired`` rounds (default 60) in one process, the order swapped each round; the cost is
the median over rounds of each round's with / without, with its 95%
interval (separate launches, and even single rounds, differ by more than
the cost on a shared machine), and the best of each beside it. ``checks``
(not in the default list) is ``current`` plus the same paired line for the
load's metadata stage (``checkpoint.checks.load_checks``: ``.metadata`` against the
files' sizes before anything is allocated): the same checkpoint loaded with
the stage left out and run. ``reads`` (not in the default list) is the same
for the read stage: the pickle budgets, the guarded unpickling of
``.metadata`` and its field types (``pickle_budget``, ``unpickling``,
``metadata_fields``) left out (``.metadata`` then read by ``pickle.loads``,
as DCP reads it) and run.

Prints, per method: optimizer bytes/param on disk and on disk over in
memory, the first step's time, save time and the peak RSS growth during the
save, and per load target: load time, peak RSS growth during the load
(``benchmarks.rss``: the region's own high-water mark) against
the loaded state plus the largest parameter shard of that rank, and the
first-update relative L2 error vs the uninterrupted run (overall, and the
worst parameter). Then the targets against AdamW in the same run (save
<= 0.5x, every load <= 1.0x, load peak <= state + one parameter shard) for
the current format; a missed one is re-run under cProfile on rank 0 and
the top of the profile printed (where the time goes).

    python scripts/bench_checkpoint.py                              # debug model, all four methods
    python scripts/bench_checkpoint.py --model 150M --methods current,gefen-x,adamw
    python scripts/bench_checkpoint.py --methods current,gefen-muon,adamw
    python scripts/bench_checkpoint.py --model 150M --methods current,checks,adamw --load-ranks 2
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {"debug": "debugmodel", "150M": "150M"}
DEFAULT_METHODS = ("current", "v1", "gefen-x", "adamw")
METHODS = (*DEFAULT_METHODS, "gefen-muon", "digests", "checks", "reads")
# recipes/llama_gefen_muon.toml's split: GefenMuon for the hidden matrices, Gefen (the shorthand) for the rest.
MUON_PATTERN = r"^layers\.\d+\.(attention|feed_forward)\."
MUON_KWARGS = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "adjust_lr_fn": "match_rms_adamw", "normuon": True}
SAVE_TARGET, LOAD_TARGET, PEAK_TARGET = 0.5, 1.0, 1.0
OURS = ("current", "v1", "gefen-muon", "digests", "checks", "reads")  # saved and loaded as GefenCheckpointManager does
PAIRED = 60  # --paired default: rounds of a save/load without and with digests (method "digests"; ~0.1-0.3 s each)


def method_label(method: str) -> str:
    """The method's row name; ``current`` names the format a run writes today."""
    if method in ("current", "digests", "checks", "reads"):
        from gefen_titan.checkpoint.format import schema
        from gefen_titan.optim.container import GefenOptimizersContainer

        blocking = GefenOptimizersContainer.Config().blocking.mode
        version = schema.VERSION if blocking == "agreed" else schema.V1
        suffix = {"digests": " (paired digests)", "checks": " (paired metadata checks)",
                  "reads": " (paired read stage)"}.get(method, "")
        return f"gefen-titan v{version} ({blocking}, current){suffix}"
    return {"v1": "gefen-titan v1 (per_rank)", "gefen-x": "gefen-x GefenDCPState", "adamw": "AdamW",
            "gefen-muon": "gefen-titan GefenMuon + Gefen (agreed)"}[method]


def _blocking(method: str) -> str:
    # GefenDCPState checkpoints gefen-x's own optimizer: per-rank periods and codebooks.
    if method in ("v1", "gefen-x"):
        return "per_rank"
    if method == "gefen-muon":
        return "agreed"  # GefenMuon's sharded step needs it
    from gefen_titan.optim.container import GefenOptimizersContainer

    return GefenOptimizersContainer.Config().blocking.mode


# --------------------------------------------------------------------- worker
def _worker(args) -> None:
    import cProfile
    import gc
    import hashlib

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torchtitan.tools.utils import GarbageCollection

    from benchmarks.rss import PeakRSS
    from gefen_titan import patches
    from gefen_titan.recipe import flavors

    patches.apply_all()  # CPU / gloo FSDP2
    flavors.register_flavors()  # --model 150M
    from torchtitan.models.llama3 import model_registry

    from gefen_titan.optim.blocking_options import BlockingOptions
    from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # As torchtitan's trainer runs (GarbageCollection: the automatic
    # collector off, a full collection every training.gc_freq steps). With it
    # on, a full collection (0.3-0.5 s here) fell every 16th load and, the
    # rounds' allocations being the same each time, always into the same arm
    # of the paired measurement: 4-9 points on a cost of a few percent.
    GarbageCollection()
    torch.manual_seed(0)
    model = model_registry(MODELS[args.model], attn_backend="flex").model.build()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = GefenOptimizersContainer.Config(
        # Set, not left to the catch-all: with param_groups only set keys reach the groups.
        name="AdamW" if args.method == "adamw" else "Gefen", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
        implementation="for-loop",
        blocking=BlockingOptions(mode=_blocking(args.method)),
        param_groups=[ParamGroup(pattern=MUON_PATTERN, optimizer_name="GefenMuon", optimizer_kwargs=MUON_KWARGS),
                      ParamGroup(pattern=".*")] if args.method == "gefen-muon" else [],
    ).build(model_parts=[model])

    def set_grads(step):
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(step * 1000 + i)
            full = torch.randn(p.shape, generator=g)
            full *= torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=g) * 2 + 0.1
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            local = full[offset[0] : offset[0] + shape[0]].clone()
            del full
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())

    def next_update():
        """Step ``args.steps + 1``: digests of the weights before it, and (rank 0) the update it made."""
        before = {}
        for n, p in model.named_parameters():
            full = p.detach().full_tensor()
            if rank == 0:
                before[n] = full.clone()
        set_grads(args.steps + 1)
        opt.step()
        update, digests = {}, {}
        for n, p in model.named_parameters():
            full = p.detach().full_tensor()
            if rank == 0:
                digests[n] = hashlib.sha1(before[n].numpy().tobytes()).hexdigest()
                update[n] = full.sub_(before.pop(n))
        return digests, update

    def state_obj():
        if args.method == "gefen-x":
            from gefen import GefenDCPState

            return GefenDCPState(opt.optimizers[0])
        return opt

    def largest_shard() -> int:
        return max(p.to_local().nbytes for p in model.parameters())

    def load_current(ckpt: str, bounds: bool = True, unchecked: bool = False) -> None:  # as the manager reads it
        import functools

        from gefen_titan.checkpoint.format import digests
        from gefen_titan.checkpoint.io import storage
        from gefen_titan.checkpoint.io.reading import LoadChecks

        with digests.parsed_once():
            # The manager's reader (unchecked: checkpoint.load_without_digests, for method "digests"'s save
            # without them); bounds=False: the same without the metadata stage (method "checks").
            reader = storage.load_reader(ckpt, load_without_digests=unchecked) if bounds else storage.storage_reader(
                ckpt, check_unread=True, load_checks=LoadChecks(stray_bytes=functools.partial(storage.stray_bytes,
                                                                                              ckpt)))
            md = reader.checked_metadata()
            opt.prepare_load(ckpt, md, prefix="optimizer.")
            try:
                dcp.load({"optimizer": opt}, storage_reader=reader)
            finally:
                opt.abort_load()

    def paired(plain, checked) -> dict:
        """A cost on its own (the digests', the metadata checks'): without and with, ``--paired`` rounds in
        this process, the order swapped every round (ABBA: neither always runs second); every time kept."""
        times: dict = {"plain": [], "digests": []}
        for n in range(args.paired):
            gc.collect(1)  # untimed, as GarbageCollection.collect's periodic one: each round from the same heap
            order = (("plain", plain), ("digests", checked))
            for label, fn in order if n % 2 == 0 else order[::-1]:
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[label].append(time.perf_counter() - t0)
        return times

    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    result = {}
    if args.mode == "save":
        for step in range(1, args.steps + 1):
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
        kwargs = {}
        if args.method in OURS:  # as GefenCheckpointManager.dcp_save writes it
            from gefen_titan.checkpoint.io import storage

            kwargs["storage_writer"] = storage.storage_writer(args.ckpt)
        if args.method == "gefen-x":
            from gefen import GefenSavePlanner

            kwargs["planner"] = GefenSavePlanner()
        # Weights in their own checkpoint, untimed: the figures are the optimizer's alone.
        dcp.save({"model": dict(model.named_parameters())}, checkpoint_id=args.ckpt + ".model")
        dist.barrier()
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            dcp.save({"optimizer": state_obj()}, checkpoint_id=args.ckpt, **kwargs)
            if profiler:
                profiler.disable()
            dist.barrier()
            result["save_s"] = time.perf_counter() - t0
        result["rss"] = {"growth": rss.growth, "state": state_bytes, "shard": largest_shard(), "method": rss.method}
        if args.method == "digests":
            from gefen_titan.checkpoint.io import storage

            result["paired_s"] = paired(
                lambda: dcp.save({"optimizer": state_obj()},
                                 storage_writer=storage.storage_writer(args.ckpt + ".plain", digests=False)),
                lambda: dcp.save({"optimizer": state_obj()},
                                 storage_writer=storage.storage_writer(args.ckpt + ".again")))
        digests, update = next_update()
    else:
        # Weights first and untimed: the figures are the optimizer's alone.
        # The live parameters (model.state_dict() splits the fused wqkv).
        dcp.load({"model": dict(model.named_parameters())}, checkpoint_id=args.ckpt + ".model")
        dist.barrier()
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            if args.method in OURS:
                load_current(args.ckpt)
            else:
                dcp.load({"optimizer": state_obj()}, checkpoint_id=args.ckpt)
            if profiler:
                profiler.disable()
            dist.barrier()
            result["load_s"] = time.perf_counter() - t0
        state_bytes, numel = opt.state_bytes()
        result["rss"] = {"growth": rss.growth, "state": state_bytes, "shard": largest_shard(), "method": rss.method}
        result["state_bytes_per_param"] = state_bytes / numel
        if args.method == "digests":
            # The same reader: a checkpoint without .digests is read unchecked.
            result["paired_s"] = paired(lambda: load_current(args.ckpt + ".plain", unchecked=True),
                                        lambda: load_current(args.ckpt))
        elif args.method == "checks":  # the same checkpoint, the load's metadata stage left out / run
            result["paired_s"] = paired(lambda: load_current(args.ckpt, bounds=False), lambda: load_current(args.ckpt))
        elif args.method == "reads":  # the same checkpoint, the read stage left out / run
            import pickle

            from gefen_titan.checkpoint.checks import metadata_fields
            from gefen_titan.checkpoint.format import pickle_budget, unpickling

            def without_read_stage() -> None:
                # The budgets, the field types and the guarded unpickling of .metadata left out: this
                # benchmark's own checkpoint, unpickled by the C unpickler as DCP itself does.
                kept = pickle_budget.check, metadata_fields.check, unpickling.unpickle_metadata
                pickle_budget.check = metadata_fields.check = lambda *a, **k: None
                unpickling.unpickle_metadata = lambda raw, source="": pickle.loads(raw)
                try:
                    load_current(args.ckpt)
                finally:
                    pickle_budget.check, metadata_fields.check, unpickling.unpickle_metadata = kept

            result["paired_s"] = paired(without_read_stage, lambda: load_current(args.ckpt))
        digests, update = next_update()
    if profiler:
        profiler.dump_stats(args.profile)
    result["numel"] = sum(p.numel() for p in model.parameters())
    everyone = [None] * world
    dist.all_gather_object(everyone, result["rss"])
    if rank == 0:
        result["rss"] = everyone
        result["digests"] = digests
        if args.mode == "save" and args.update_out:
            torch.save(update, args.update_out)
        elif args.mode == "load" and args.reference:
            ref = torch.load(args.reference, weights_only=True)
            result["weights_equal"] = ref.pop("__digests__") == digests
            result["err"], result["worst"] = _rel(update, ref)
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- orchestrator
def _launch(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master-port=29655", "-m", "benchmarks.checkpoint", "--worker", *args]
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


def peak_ratio(rss: list[dict]) -> float:
    """Worst rank's peak RSS growth over its loaded state plus its largest parameter shard."""
    return max(r["growth"] / (r["state"] + r["shard"]) for r in rss)


def profile_top(path: str, n: int = 14) -> str:
    out = io.StringIO()
    pstats.Stats(path, stream=out).strip_dirs().sort_stats("cumulative").print_stats(n)
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="debug")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, from {', '.join(METHODS)} (AdamW is the baseline: keep it)")
    ap.add_argument("--save-ranks", type=int, default=2)
    ap.add_argument("--load-ranks", default="2,4,1")
    ap.add_argument("--steps", type=int, default=3, help="training steps before the save")
    ap.add_argument("--paired", type=int, default=PAIRED,
                    help="methods digests, checks: rounds of the paired without / with measurement")
    ap.add_argument("--no-profile", action="store_true", help="do not re-run missed targets under cProfile")
    ap.add_argument("--json", default="", help="also write every figure here")
    for hidden in ("--mode", "--method", "--ckpt", "--out", "--update-out", "--reference", "--profile"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        ap.error(f"--methods: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(METHODS)}")
    if "adamw" not in args.methods:
        ap.error("--methods must include adamw: every target is a ratio against AdamW in the same run")
    try:
        args.load_ranks = [int(x) for x in args.load_ranks.split(",")]
    except ValueError:
        ap.error(f"--load-ranks: expected comma-separated integers, got {args.load_ranks!r}")
    if args.save_ranks < 1 or any(m < 1 for m in args.load_ranks) or args.steps < 1 or args.paired < 1:
        ap.error("--save-ranks, --load-ranks, --steps and --paired must be >= 1")
    return args


def run(args: argparse.Namespace, tmp: str) -> list[dict]:
    import torch

    rows = []
    common = ["--model", args.model, "--steps", str(args.steps), "--paired", str(args.paired)]
    for method in args.methods:
        ckpt = os.path.join(tmp, method)
        out, update = os.path.join(tmp, f"{method}-save.json"), os.path.join(tmp, f"{method}-update.pt")
        _launch(args.save_ranks, *common, "--mode", "save", "--method", method, "--ckpt", ckpt, "--out", out,
                "--update-out", update)
        saved = json.load(open(out))
        ref = torch.load(update, weights_only=True)
        ref["__digests__"] = saved["digests"]
        torch.save(ref, update)
        del ref
        disk = _disk_bytes(ckpt)
        row = {"method": method, "label": method_label(method), "numel": saved["numel"],
               "bpp_disk": disk / saved["numel"], "disk_over_memory": disk / saved["memory_bytes"],
               "first_step_s": saved["first_step_s"], "save_s": saved["save_s"], "save_rss": saved["rss"],
               "paired_save_s": saved.get("paired_s"),
               "ckpt": ckpt, "loads": {}}
        for m in args.load_ranks:
            out = os.path.join(tmp, f"{method}-load{m}.json")
            _launch(m, *common, "--mode", "load", "--method", method, "--ckpt", ckpt, "--out", out,
                    "--reference", update)
            loaded = json.load(open(out))
            # The comparison is only meaningful if the weights came back whole.
            assert loaded["weights_equal"], f"{method}: weights differ after the load at {m}"
            row["loads"][m] = {"load_s": loaded["load_s"], "paired_s": loaded.get("paired_s"), "rss": loaded["rss"],
                               "err": loaded["err"],
                               "worst": loaded["worst"], "state_bpp": loaded["state_bytes_per_param"]}
        os.remove(update)
        rows.append(row)
        print(f"done: {row['label']}", file=sys.stderr, flush=True)
    return rows


def targets(rows: list[dict], n: int, loads: list[int]) -> list[dict]:
    """The issue's targets for the current format, each with its measured figure."""
    by = {r["method"]: r for r in rows}
    ours, adamw = by.get("current"), by["adamw"]
    if ours is None:
        return []
    out = [{"what": "save", "ratio": ours["save_s"] / adamw["save_s"], "target": SAVE_TARGET, "mode": "save",
            "ranks": n}]
    for m in loads:
        out.append({"what": f"load {n}->{m}", "ratio": ours["loads"][m]["load_s"] / adamw["loads"][m]["load_s"],
                    "target": LOAD_TARGET, "mode": "load", "ranks": m})
    for m in loads:
        out.append({"what": f"peak RSS growth during load {n}->{m} / (state + largest shard)",
                    "ratio": peak_ratio(ours["loads"][m]["rss"]), "target": PEAK_TARGET, "mode": None, "ranks": m})
    for t in out:
        t["met"] = t["ratio"] <= t["target"]
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def report(rows: list[dict], args: argparse.Namespace) -> str:
    n, loads = args.save_ranks, args.load_ranks
    numel = rows[0]["numel"]
    lines = [f"Llama 3 {MODELS[args.model]} ({numel / 1e6:.2f}M params), optimizer state saved at {n} ranks after "
             f"{args.steps} steps, loaded at {', '.join(map(str, loads))} (gloo, CPU); peak RSS growth is the worst "
             "rank's, in MiB, and in brackets over that rank's loaded state plus its largest parameter shard", ""]
    head = "| method | on disk B/param | disk / memory | first step s | save s | save peak MiB |" + "".join(
        f" load {n}->{m} s | peak MiB (/bound) | 1st-update err (worst param) |" for m in loads)
    lines += [head, "|" + "---|" * (6 + 3 * len(loads))]
    for row in rows:
        cells = [row["label"], f"{row['bpp_disk']:.3f}", f"{row['disk_over_memory']:.4f}",
                 f"{row['first_step_s']:.2f}", f"{row['save_s']:.2f}", _mib(max(r["growth"] for r in row["save_rss"]))]
        for m in loads:
            ld = row["loads"][m]
            err = "identical" if ld["err"] == 0 and ld["worst"] == 0 else f"{ld['err']:.2e} ({ld['worst']:.2e})"
            peak = f"{_mib(max(r['growth'] for r in ld['rss']))} ({peak_ratio(ld['rss']):.2f})"
            cells += [f"{ld['load_s']:.2f}", peak, err]
        lines.append("| " + " | ".join(cells) + " |")
    adamw = next(r for r in rows if r["method"] == "adamw")
    lines.append("")
    for ours in rows:
        if ours is adamw:
            continue
        ratios = "; ".join(f"load {n}->{m} x{ours['loads'][m]['load_s'] / adamw['loads'][m]['load_s']:.2f}"
                           for m in loads)
        lines.append(f"{ours['label']} vs AdamW in this run: save x{ours['save_s'] / adamw['save_s']:.2f}; {ratios}")
    dg = next((r for r in rows if r["method"] == "digests"), None)
    if dg is not None:
        loads_cost = "; ".join(f"load {n}->{m} {_pct(dg['loads'][m]['paired_s'])}" for m in loads)
        lines.append(f"digest cost on its own (without / with, in one process, order swapped each round): save "
                     f"{_pct(dg['paired_save_s'])}; {loads_cost}")
    ck = next((r for r in rows if r["method"] == "checks"), None)
    if ck is not None:
        loads_cost = "; ".join(f"load {n}->{m} {_pct(ck['loads'][m]['paired_s'])}" for m in loads)
        lines.append(f"metadata checks' cost on its own (load_checks' metadata stage left out / run, in one process, "
                     f"order swapped each round; a save runs no check): {loads_cost}")
    rd = next((r for r in rows if r["method"] == "reads"), None)
    if rd is not None:
        loads_cost = "; ".join(f"load {n}->{m} {_pct(rd['loads'][m]['paired_s'])}" for m in loads)
        lines.append(f"read stage's cost on its own (pickle budgets, guarded .metadata unpickling and field types left "
                     f"out / run, "
                     f"in one process, order swapped each round): {loads_cost}")
    return "\n".join(lines)


def _pct(paired: dict) -> str:
    """The digests' cost: the median over rounds of with / without (each round's pair ran back to back),
    with a distribution-free 95% interval of that median (order statistics), and the best of each."""
    plain, checked = paired["plain"], paired["digests"]
    ratios = sorted(c / p for p, c in zip(plain, checked))
    n = len(ratios)
    k = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))  # 0-based: ratios[k] .. ratios[n - 1 - k]
    return (f"{100 * (statistics.median(ratios) - 1):+.1f}% (median of {n} paired rounds, 95% interval "
            f"{100 * (ratios[k] - 1):+.1f}%..{100 * (ratios[n - 1 - k] - 1):+.1f}%; best of each "
            f"{min(plain):.3f} s -> {min(checked):.3f} s)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args, tmp)
        print("\n" + report(rows, args))
        checks = targets(rows, args.save_ranks, args.load_ranks)
        if checks:
            print("\ntargets (current format vs AdamW, same run):")
        for t in checks:
            print(f"  {t['what']}: x{t['ratio']:.2f} (target <= {t['target']:.1f}): {'met' if t['met'] else 'MISSED'}")
        for t in checks:
            if t["met"] or t["mode"] is None or args.no_profile:
                continue
            prof = os.path.join(tmp, "profile.out")
            ckpt = next(r["ckpt"] for r in rows if r["method"] == "current")
            if t["mode"] == "save":
                ckpt = os.path.join(tmp, "profiled-save")
            _launch(t["ranks"], "--model", args.model, "--steps", str(args.steps), "--mode", t["mode"],
                    "--method", "current", "--ckpt", ckpt, "--out", os.path.join(tmp, "profile.json"),
                    "--profile", prof)
            if os.path.exists(prof):
                print(f"\nMISSED {t['what']}: where rank 0's time goes (cProfile, cumulative):\n{profile_top(prof)}")
        if args.json:
            for row in rows:
                row.pop("ckpt", None)
            with open(args.json, "w") as f:
                json.dump({"args": dict(vars(args)), "rows": rows, "targets": checks}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
