"""One rank of the agreed-blocking layout runs, launched by tests via torchrun.

A small Llama-like model (embedding, attention-less MLP blocks with norms,
an output projection, and a 2-row matrix so that W=3 has an empty shard)
under one of these layouts, built with the real torch APIs:

  fsdp      FSDP2 over all ranks (uneven rows at W=3)
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
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

from gefen_titan import patches
from tests.helpers import worker_jobs

patches.apply_all()  # CPU / gloo FSDP2
from torchtitan.components.optimizer import LRSchedulersContainer

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.optim import gefen_state as gs
from gefen_titan.optim.container import GefenOptimizersContainer

VOCAB, DIM, HIDDEN, LAYERS = 256, 64, 192, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        # A ModuleDict, as torchtitan's models: a pipeline split deletes
        # entries and the remaining FQNs stay those of the whole model.
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.gate = nn.Linear(DIM, 2, bias=False)  # 2 rows: an empty shard at W=3
        self.output = nn.Linear(DIM, VOCAB, bias=False)


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def global_grad(name: str, shape, step: int) -> torch.Tensor:
    seed = (sum(map(ord, name)) * 7919 + step) % (2**31)
    g = torch.Generator().manual_seed(seed)
    # Heavy-ish tails and a per-row scale, like real gradients.
    rows = shape[0] if len(shape) > 1 else 1
    scale = torch.rand(rows, 1, generator=g) * 2 + 0.1 if len(shape) > 1 else 1.0
    return (torch.randn(*shape, generator=g) ** 3 * scale * 1e-2).reshape(shape)


def build(layout: str, world: int, max_tp: int, **config):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Net()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "pp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp_shard"))
        stage = mesh.get_coordinate()[0]
        if stage == 0:
            del model.layers["1"]
            model.norm = model.gate = model.output = None
        else:
            del model.layers["0"]
            model.tok_embeddings = None
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout in ("fsdp_tp", "tp"):
        dp = 2 if layout == "fsdp_tp" else 1
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp_shard", "tp"))
        tp = mesh["tp"]
        for layer in model.layers.values():
            parallelize_module(layer, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        parallelize_module(model, tp, {"output": ColwiseParallel(), "tok_embeddings": RowwiseParallel()})
        if dp > 1:
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh["dp_shard"])
            fully_shard(model, mesh=mesh["dp_shard"])
    else:
        raise ValueError(layout)
    worker_jobs.own(mesh)
    opt = GefenOptimizersContainer.Config(
        name="Gefen", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, max_tensor_parallel_degree=max_tp, **config
    ).build(model_parts=[model])
    return model, opt


def set_grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        full = global_grad(name, tuple(p.shape), step)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        else:
            p.grad = full


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def global_state(opt: GefenOptimizersContainer) -> dict:
    """This rank's stage of the job's Gefen state as global tensors.

    Through the checkpoint entries (so the save format is what is compared)
    plus the live periods, codebook and global step; every rank of a stage
    has the same picture.
    """
    sd = opt.state_dict()
    out = {k: (full(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items() if k.startswith("gefen/")}
    (optim,) = opt.gefen_optimizers
    out["periods"] = {n: gs.period(optim, p) for n, p, _ in gs.named_params(optim)}
    out["codebook"] = gs.codebook(optim).cpu().clone()
    out["global_step"] = gs.global_step(optim)
    return out


def snapshot(opt: GefenOptimizersContainer) -> dict:
    """This rank's live Gefen state, copied (fail-closed checks)."""
    out = {}
    for optim in opt.gefen_optimizers:
        out["codebook"] = None if gs.codebook(optim) is None else gs.codebook(optim).clone()
        out["global_step"] = gs.global_step(optim)
        for n, p, group in gs.named_params(optim):
            st = gs.read(optim, p)
            out[n] = None if st is None else (st.period, st.step, st.vmean_step, st.codes.clone(),
                                              st.magnitude.clone(), st.vmean.clone(), float(group["lr"]))
    return out


def full_params(model):
    return {n: full(p) for n, p in model.named_parameters()}


def make_ckpt(model, opt, sched, train_state, folder, interval):
    return GefenCheckpointManager.Config(
        enable=True, folder="ckpt", interval=interval, last_save_model_only=False, keep_latest_k=0,
    ).build(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
            states={"train_state": train_state}, sd_adapter=None, base_folder=folder)


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
    return ap


def job(args, rank: int, world: int) -> None:
    S, K = args.save_step, args.steps
    results = {"ref": None, "resume": {}, "cases": {}}

    def fresh(**config):
        max_tp = int(config.pop("max_tp", args.max_tp))
        model, opt = build(args.layout, world, max_tp, **config)
        sched = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=None, min_lr_factor=0.1).build(
            optimizers=opt, training_steps=S + K)
        return model, opt, sched, TrainState()

    if args.ref:
        model, opt, sched, ts = fresh(blocking=args.blocking)
        ckpt = make_ckpt(model, opt, sched, ts, args.ref, S)
        res = {"params": {}}
        for s in range(1, S + K + 1):
            step(model, opt, sched, s)
            ts.step = s
            if s == S:
                ckpt.save(s)
                res["state"] = global_state(opt)
                res["bytes"] = opt.state_bytes()
            if s >= S:
                res["params"][s] = full_params(model)
        ckpt.close()
        results["ref"] = res
    if args.load:
        with worker_jobs.no_codebook_learning():
            for base in args.load.split(","):
                model, opt, sched, ts = fresh(blocking=args.blocking)
                ckpt = make_ckpt(model, opt, sched, ts, base, S)
                assert ckpt.load(step=S)
                res = {"state": global_state(opt), "params": {S: full_params(model)}}
                for s in range(S + 1, S + K + 1):
                    step(model, opt, sched, s)
                    res["params"][s] = full_params(model)
                ckpt.close()
                results["resume"][os.path.basename(base)] = res
    for case in filter(None, args.cases.split(",")):
        # A stepped optimizer (with the case's config) tries a bad checkpoint.
        base, *overrides = case.split("|")
        config = {}
        for item in overrides:
            key, value = item.split("=")
            config[key] = value if key == "blocking" else bool(int(value)) if key == "deterministic" else int(value)
        model, opt, sched, ts = fresh(**config)
        step(model, opt, sched, 1)
        ckpt = make_ckpt(model, opt, sched, ts, base, S)
        before = snapshot(opt)
        try:
            ckpt.load(step=S)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        results["cases"][os.path.basename(base) + "".join(overrides)] = {
            "error": error, "before": before, "after": snapshot(opt)}
        ckpt.close()
    if args.tamper_save:
        model, opt, sched, ts = fresh()
        step(model, opt, sched, 1)
        if rank == 1:
            (optim,) = opt.gefen_optimizers
            cb = gs.codebook(optim).clone()
            cb[100] = (cb[99] + cb[100]) / 2
            gs.set_codebook(optim, cb)
        ckpt = make_ckpt(model, opt, sched, ts, args.tamper_save, 1)
        try:
            ckpt.save(1)
            results["tamper"] = None
        except Exception as e:
            results["tamper"] = f"{type(e).__name__}: {e}"
        ckpt.close()
    torch.save(results, os.path.join(args.out, f"{args.tag or args.layout + str(world)}_r{rank}.pt"))


if __name__ == "__main__":
    sys.exit(worker_jobs.run(parser(), job))
