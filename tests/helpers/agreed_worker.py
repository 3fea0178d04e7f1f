"""One rank of the agreed-blocking layout runs (tests.helpers.agreed_runs).

The small Llama-like model of ``small_model`` (embedding, MLP blocks with
norms, an output projection, and a 2-row matrix so that W=3 has an empty
shard; only its parameters are used here) under one of these layouts, built
with the real torch APIs:

  fsdp      FSDP2 over all ranks (uneven rows at W=3)
  fsdp_offload  the same with FSDP2's CPU offload (--training.enable_cpu_offload)
  fsdp_tp   FSDP 2 x TP 2 (colwise w1/output, rowwise w2 then fully_shard)
  tp        TP over all ranks, no FSDP
  hsdp      replicate 2 x shard W/2
  pp        2 pipeline stages (stage 0: embeddings and block 0; stage 1: the
            rest), each FSDP2 over its W/2 ranks: a direct harness of
            torchtitan's split (one model part per rank, FQNs kept)

Every step's gradients are a fixed function of (step, name): each rank
installs its slice of the same global gradient, so every layout sees
bit-identical gradients and every difference in the state is the
optimizer's. Real Gefen through ``GefenOptimizersContainer`` (agreed
blocking) and our ``GefenCheckpointManager``.

A launch runs one or more jobs, ``JOB [--then JOB ...]`` (``worker_jobs``:
one process group, each job its own mesh, model and optimizer, its mesh's
groups destroyed when it ends); each job does, in order, what its flags ask,
and writes ``TAG_rRANK.pt`` into its ``--out``:
  --ref BASE     steps 1..S+K, checkpoint at S into BASE; dump the global
                 state at S and the full parameters at S..S+K
  --load B1,..   for each checkpoint: fresh model and optimizer, load S, dump
                 the global state, K more steps, dump the parameters
  --cases C1,..  for each bad checkpoint: a fresh optimizer (with the case's
                 config overrides) takes one step, tries the load, and dumps
                 the error and its live state before and after
  --tamper-save  a stepped optimizer whose rank 1 has another codebook saves
  --second-moment  Gefen's ([optimizer.gefen] second_moment) for --ref and --load
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gefen_titan import patches
from tests.helpers import worker_jobs

patches.apply_all()  # CPU / gloo FSDP2
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.optim.kinds.gefen.options import GefenOptions
from tests.helpers import small_model as sm

# A 2-row gate: an empty shard at W=3.
SIZES = sm.Sizes(vocab=256, dim=64, hidden=192, layers=2, gate_rows=2)


def global_grad(name: str, shape, step: int) -> torch.Tensor:
    seed = (sum(map(ord, name)) * 7919 + step) % (2**31)
    g = torch.Generator().manual_seed(seed)
    # Heavy-ish tails and a per-row scale, like real gradients.
    rows = shape[0] if len(shape) > 1 else 1
    scale = torch.rand(rows, 1, generator=g) * 2 + 0.1 if len(shape) > 1 else 1.0
    return (torch.randn(*shape, generator=g) ** 3 * scale * 1e-2).reshape(shape)


def build(layout: str, world: int, max_tp: int, **config):
    model = sm.build_model(SIZES)
    if layout in ("fsdp", "fsdp_offload"):
        sm.shard(model, sm.dp_mesh(world), offload=layout == "fsdp_offload")
    elif layout == "pp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp_shard"))
        worker_jobs.own(mesh)
        stage = mesh.get_coordinate()[0]
        if stage == 0:
            del model.layers["1"]
            model.norm = model.gate = model.output = None
        else:
            del model.layers["0"]
            model.tok_embeddings = None
        sm.shard(model, mesh["dp_shard"])
    elif layout == "hsdp":
        sm.shard(model, sm.dp_mesh(world, replicate=2))
    elif layout in ("fsdp_tp", "tp"):
        dp = 2 if layout == "fsdp_tp" else 1
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp_shard", "tp"))
        worker_jobs.own(mesh)
        tp = mesh["tp"]
        for layer in model.layers.values():
            parallelize_module(layer, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        parallelize_module(model, tp, {"output": ColwiseParallel(), "tok_embeddings": RowwiseParallel()})
        if dp > 1:
            sm.shard(model, mesh["dp_shard"])
    else:
        raise ValueError(layout)
    blocking = BlockingOptions(mode=config.pop("blocking", "agreed"), max_tensor_parallel_degree=max_tp)
    return model, sm.optimizer(model, blocking=blocking, **config)


def set_grads(model: nn.Module, step: int) -> None:
    for name, p in model.named_parameters():
        full = global_grad(name, tuple(p.shape), step)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        else:
            p.grad = full


def global_state(opt: GefenOptimizersContainer) -> dict:
    """This rank's stage of the job's Gefen state as global tensors.

    Through the checkpoint entries (so the save format is what is compared)
    plus the live periods, codebook and global step; every rank of a stage
    has the same picture.
    """
    sd = opt.state_dict()
    out = {k: (sm.full(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items() if k.startswith("gefen/")}
    (optim,) = opt.optimizers_of("Gefen")
    out["periods"] = {n: gx.period(optim, p) for n, p, _ in gx.named_params(optim)}
    out["codebook"] = gx.codebook(optim).cpu().clone()
    out["global_step"] = gx.global_step(optim)
    return out


def snapshot(opt: GefenOptimizersContainer) -> dict:
    """This rank's live Gefen state, copied (fail-closed checks)."""
    out = {}
    for optim in opt.optimizers_of("Gefen"):
        out["codebook"] = None if gx.codebook(optim) is None else gx.codebook(optim).clone()
        out["global_step"] = gx.global_step(optim)
        for n, p, group in gx.named_params(optim):
            st = gx.gefen_read(optim, p)
            if st is None:
                out[n] = None
                continue
            second = (st.v_row, st.v_col) if st.factored else (st.vmean,)
            out[n] = (st.period, st.step, st.vmean_step, st.codes.clone(), st.magnitude.clone(),
                      *(t.clone() for t in second), float(group["lr"]))
    return out


def step(model, opt, sched, s):
    set_grads(model, s)
    opt.step()
    sched.step()
    opt.zero_grad()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="fsdp")
    ap.add_argument("--ref", default="", help="checkpoint base of an uninterrupted run (saved at S)")
    ap.add_argument("--load", default="", help="comma-separated checkpoint bases to resume from")
    ap.add_argument("--cases", default="",
                    help="comma-separated bad checkpoints, each BASE[|key=value...] of config overrides")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--save-step", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-tp", type=int, default=2)
    ap.add_argument("--blocking", default="agreed", help="for --ref and --load")
    ap.add_argument("--tamper-save", default="", help="a base to save into after rank 1's codebook is changed")
    ap.add_argument("--second-moment", default="auto", choices=("auto", "block", "factored"),
                    help="Gefen's, for --ref and --load (auto, the default: factored under agreed blocking)")
    return ap


def job(args, rank: int, world: int) -> None:
    S, K = args.save_step, args.steps
    results = {"ref": None, "resume": {}, "cases": {}}

    def fresh(**config):
        max_tp = int(config.pop("max_tp", args.max_tp))
        model, opt = build(args.layout, world, max_tp, **config)
        return model, opt, sm.schedulers(opt, S + K), sm.TrainState()

    def run_config() -> dict:
        return {"blocking": args.blocking, "gefen": GefenOptions(second_moment=args.second_moment)}

    if args.ref:
        results["ref"], _ = sm.reference_run(lambda: fresh(**run_config()), step, args.ref, S, K, global_state)
    if args.load:
        results["resume"] = sm.resumes(args.load.split(","), lambda: fresh(**run_config()), step, S, K,
                                       global_state)
    for case in filter(None, args.cases.split(",")):
        # A stepped optimizer (with the case's config) tries a bad checkpoint.
        base, *overrides = case.split("|")
        config = {}
        for item in overrides:
            key, value = item.split("=")
            if key == "deterministic":  # Gefen's own option, in its [optimizer.gefen] table
                config["gefen"] = GefenOptions(deterministic=bool(int(value)))
            else:
                config[key] = value if key == "blocking" else int(value)
        results["cases"][os.path.basename(base) + "".join(overrides)] = sm.bad_checkpoint_case(
            base, lambda: fresh(**config), step, S, snapshot)
    if args.tamper_save:
        model, opt, sched, ts = fresh()
        step(model, opt, sched, 1)
        if rank == 1:
            (optim,) = opt.optimizers_of("Gefen")
            cb = gx.codebook(optim).clone()
            cb[100] = (cb[99] + cb[100]) / 2
            gx.set_codebook(optim, cb)
        ckpt = sm.checkpointer(model, opt, sched, ts, args.tamper_save, 1)
        try:
            ckpt.save(1)
            results["tamper"] = None
        except Exception as e:
            results["tamper"] = f"{type(e).__name__}: {e}"
        ckpt.close()
    torch.save(results, os.path.join(args.out, f"{args.tag or args.layout + str(world)}_r{rank}.pt"))


if __name__ == "__main__":
    sys.exit(worker_jobs.run(parser(), job))
