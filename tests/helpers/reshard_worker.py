"""One rank of a save-at-N / load-at-M run (tests.helpers.reshard_runs).

Per-rank blocking (format v1, ``--blocking per_rank``) by default here: the
agreed default is covered by ``agreed_worker.py``.

The small real model of ``small_model`` (embedding, MLP blocks with norms,
output projection; uneven rows at 3 ranks) under FSDP2 on gloo, trained with
the real Gefen through ``GefenOptimizersContainer``, torchtitan's LR
schedulers and our ``GefenCheckpointManager``. The global batch of every step is a function of
the step alone and each rank takes its slice, so runs at different world
sizes see the same gradients (up to the order of the reduction).

A launch runs one or more jobs, ``JOB [--then JOB ...]`` (``worker_jobs``:
one process group, each job its own mesh, model, optimizer and checkpoint
manager, their groups destroyed when it ends); each job writes
``MODE_wWORLD_rRANK.pt`` into its ``--out``. Modes:
  ref     train --save-step + --steps steps from a fixed seed, checkpoint at
          --save-step, dump the optimizer state there and params after each
          later step
  resume  build fresh, load --save-step, dump the loaded state, train --steps
          more steps dumping params
  corrupt build fresh, take one step, then try to load each checkpoint root
          of --cases in turn, dumping per case whether it raised, the error,
          and the state before/after (fail-closed tests)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gefen_titan import patches
from tests.helpers import worker_jobs

patches.apply_all()  # CPU / gloo FSDP2
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.kinds.gefen.per_rank_regions import param_region
from tests.helpers import small_model as sm

SIZES = sm.Sizes(vocab=512, dim=128, hidden=384, layers=2)
GLOBAL_BATCH, SEQ = 12, 32


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(SIZES.vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    mine = data[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def build(world: int, args):
    model = sm.build_model(SIZES)
    # HSDP: replicate x shard, the replicas hold identical Gefen state.
    sm.shard(model, sm.dp_mesh(world, replicate=args.hsdp or 1))
    opt = sm.optimizer(model, name=args.optimizer, blocking=BlockingOptions(mode=args.blocking))
    sched = sm.schedulers(opt, args.save_step + args.steps)
    train_state = sm.TrainState()
    ckpt = sm.checkpointer(model, opt, sched, train_state, args.ckpt, args.save_step, async_mode=args.async_mode)
    return model, opt, sched, ckpt, train_state


def train_step(model, opt, sched, step, rank, world):
    x, y = batch(step, rank, world)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    # The global mean loss (ranks hold equal-sized slices).
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / world


def snapshot(opt):
    """This rank's raw Gefen state, by parameter name."""
    out = {}
    for optim in opt.optimizers_of("Gefen"):
        cb = gx.codebook(optim)
        for name, p, group in gx.named_params(optim):
            st = gx.gefen_read(optim, p)
            region, _ = param_region(name, p)
            rec = {"start": region.start, "length": region.length, "shape": tuple(p.shape)}
            if st is not None:
                rec.update(
                    period=st.period, step=st.step, vmean_step=st.vmean_step,
                    codes=st.codes.clone(), magnitude=st.magnitude.clone(), vmean=st.vmean.clone(),
                    codebook=cb.clone(), global_step=gx.global_step(optim),
                    lr=float(group["lr"]), beta1=group["beta1"], beta2=group["beta2"],
                )
            out[name] = rec
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ref", "resume", "corrupt"], required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-step", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--async-mode", default="disabled")
    ap.add_argument("--optimizer", default="Gefen")
    ap.add_argument("--blocking", default="per_rank", choices=["per_rank", "agreed"])
    ap.add_argument("--hsdp", type=int, default=0, help="replicate degree (HSDP) instead of plain FSDP")
    ap.add_argument("--cases", default="", help="comma-separated checkpoint roots (corrupt mode)")
    return ap


def job(args, rank: int, world: int) -> None:
    model, opt, sched, ckpt, train_state = build(world, args)
    result = {"world": world, "rank": rank, "losses": {}, "params": {}}

    if args.mode == "ref":
        for step in range(1, args.save_step + args.steps + 1):
            result["losses"][step] = train_step(model, opt, sched, step, rank, world)
            train_state.step = step
            if step == args.save_step:
                # Async saves write while later steps mutate the state in
                # place: the snapshot must still be what gets read back.
                ckpt.save(step)
                result["state"] = snapshot(opt)
            if step >= args.save_step:
                result["params"][step] = sm.full_params(model)
        ckpt.maybe_wait_for_saving()
    elif args.mode == "resume":
        with worker_jobs.no_codebook_learning():
            assert ckpt.load(step=args.save_step)
            assert train_state.step == args.save_step
            result["state"] = snapshot(opt)
            result["params"][args.save_step] = sm.full_params(model)
            for step in range(args.save_step + 1, args.save_step + args.steps + 1):
                result["losses"][step] = train_step(model, opt, sched, step, rank, world)
                result["params"][step] = sm.full_params(model)
    else:
        train_step(model, opt, sched, 1, rank, world)
        result["cases"] = {}
        for case in args.cases.split(","):
            before = snapshot(opt)
            ckpt.folder = os.path.join(case, "ckpt")
            try:
                ckpt.load(step=args.save_step)
                error = None
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            result["cases"][os.path.basename(case)] = {"error": error, "before": before, "after": snapshot(opt)}
    ckpt.close()
    torch.save(result, os.path.join(args.out, f"{args.mode}_w{world}_r{rank}.pt"))


if __name__ == "__main__":
    sys.exit(worker_jobs.run(parser(), job))
