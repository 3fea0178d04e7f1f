"""One rank of the mixture-of-experts runs (tests.helpers.moe_runs).

A small decoder shaped as torchtitan's MoE models are (what its sharding
reads): an embedding, two MoE blocks (each an attention-like ``wo``, a
norm, the router's ``gate`` and torchtitan's own ``GroupedExperts`` with
``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` of ``(E, out, in)``), a norm and an
``lm_head``; ``--experts`` experts per block. It is sharded by torchtitan
0.3.0's own code (``ParallelDims``, ``apply_fsdp_to_decoder``) after the
experts are cut by EP's ``Shard(0)`` on ``ep`` (as its parallelize does), so
the placements are the trainer's:

  one     a single process, plain tensors
  fsdp    EP 1 x FSDP over every rank (experts ``Shard(1)`` when ranks > experts)
  ep      EP 2 x efsdp (world / 2): ``_StridedShard(0)``, or ``Shard(1)`` on
          efsdp when efsdp x ep > experts
  ep4     EP 4 (efsdp 1)
  hsdp    HSDP 2 x (EP 2 x efsdp 1)

The optimizers: GefenMuon for ``wo``, ``w1_EFD`` and ``w3_EFD`` (NorMuon on;
each expert's slice a Muon matrix), Gefen for the rest (``w2_EDF`` among
them: Gefen on experts too). Every step's gradients are a fixed function of
(step, name), each rank installing the part of the global gradient its
shard holds, so every layout sees bit-identical gradients. A job does what
its flags ask and writes ``TAG_rRANK.pt`` into ``--out``:
  --ref BASE     steps 1..S+K, checkpoint at S into BASE; dump the global state
                 at S (the checkpoint entries) and the full parameters at S..S+K
  --load B1,..   for each checkpoint: fresh model and optimizer, load S, dump the
                 global state, K more steps, dump the parameters
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gefen_titan import patches
from tests.helpers import worker_jobs

patches.apply_all()  # CPU / gloo meshes and FSDP2
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.moe import GroupedExperts

from gefen_titan.distributed.layout import local_box
from gefen_titan.optim.container import ParamGroup
from tests.helpers import small_model as sm

DIM, HIDDEN, VOCAB = 64, 96, 128
MUON_PATTERN = r"^layers\.\d+\.(wo\.weight|moe\.routed_experts\.inner_experts\.w[13]_EFD)$"
MUON_KWARGS = {"lr": 0.02, "normuon": True}
MUON_BUCKET_MIB = 0.05  # several buckets; a grouped weight is never split between two


class Block(nn.Module):
    moe_enabled = True  # what torchtitan's apply_fsdp_to_decoder reads

    def __init__(self, experts: int):
        super().__init__()
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM)
        self.moe = nn.Module()
        self.moe.router = nn.Module()
        self.moe.router.gate = nn.Linear(DIM, experts, bias=False)
        self.moe.routed_experts = nn.Module()
        self.moe.routed_experts.inner_experts = GroupedExperts(
            GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=experts))


class Net(nn.Module):
    enable_weight_tying = False

    def __init__(self, experts: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(experts) for i in range(2)})
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)


def build_model(experts: int) -> Net:
    torch.manual_seed(0)
    model = Net(experts)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:  # GroupedExperts leaves its weights uninitialized
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return model


LAYOUTS = {"fsdp": dict(ep=1), "ep": dict(ep=2), "ep4": dict(ep=4), "hsdp": dict(ep=2, rep=2)}


def shard(model: Net, layout: str, world: int) -> None:
    """torchtitan 0.3.0's sharding of the model at ``layout`` (see the module doc)."""
    if layout == "one":
        return
    ep, rep = LAYOUTS[layout]["ep"], LAYOUTS[layout].get("rep", 1)
    dims = ParallelDims(dp_replicate=rep, dp_shard=world // rep, cp=1, tp=1, pp=1, ep=ep, world_size=world,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    # Its groups are not ``worker_jobs.own``ed: FSDP2 keeps the (efsdp, ep) meshes it concatenates in a
    # process-wide cache, which a later job of the launch gets back, groups and all (destroying them
    # here made that job fail: "Could not resolve the process group"). A launch's few jobs leak them.
    replicate = ["dp_replicate"] if rep > 1 else []
    edp = None
    if ep > 1:
        for block in model.layers.values():
            experts = block.moe.routed_experts.inner_experts
            for name, p in list(experts.named_parameters(recurse=False)):
                setattr(experts, name, nn.Parameter(distribute_tensor(p.data, dims.get_mesh("ep"), [Shard(0)])))
        edp = dims.get_optional_mesh(replicate + ["efsdp"])
    apply_fsdp_to_decoder(model, dims.get_mesh(replicate + ["fsdp"]), torch.float32, torch.float32, False,
                          ep_degree=ep, edp_mesh=edp)


def global_grad(name: str, shape, step: int) -> torch.Tensor:
    """``agreed_worker.global_grad``'s tails and per-row scale, for any number of dims."""
    g = torch.Generator().manual_seed((sum(map(ord, name)) * 7919 + step) % (2**31))
    scale = torch.rand(*shape[:-1], 1, generator=g) * 2 + 0.1 if len(shape) > 1 else 1.0
    return torch.randn(*shape, generator=g) ** 3 * scale * 1e-2


def set_grads(model: nn.Module, step: int) -> None:
    for name, p in model.named_parameters():
        full = global_grad(name, tuple(p.shape), step)
        if isinstance(p, DTensor):  # the part of the global gradient this rank's shard holds
            part = full[local_box(p).slices()].contiguous()
            p.grad = DTensor.from_local(part, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
        else:
            p.grad = full


def build(layout: str, world: int, experts: int):
    model = build_model(experts)
    shard(model, layout, world)
    opt = sm.optimizer(model, max_tensor_parallel_degree=2, muon_bucket_mib=MUON_BUCKET_MIB, param_groups=[
        ParamGroup(pattern=MUON_PATTERN, optimizer_name="GefenMuon", optimizer_kwargs=dict(MUON_KWARGS)),
        ParamGroup(pattern=".*")])
    return model, opt


def step(model, opt, sched, s: int) -> None:
    set_grads(model, s)
    opt.step()
    sched.step()
    opt.zero_grad()


def global_state(opt) -> dict:
    """The checkpoint's entries (Gefen's and GefenMuon's) as global tensors, and each GefenMuon
    schedule's buckets of (matrix, owner) on this rank."""
    sd = opt.state_dict()
    out = {k: (sm.full(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items() if k.startswith("gefen/")}
    from gefen_titan.optim import gefenx as gx

    out["schedule"] = []
    for optim in opt.muon_optimizers:
        specs, sched = gx.sharded_step(optim).plan()
        out["schedule"] += [[(specs[i].fqn, o) for i, o in zip(b.matrices, b.owners)] for b in sched.buckets]
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="fsdp")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--ref", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--save-step", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    return ap


def job(args, rank: int, world: int) -> None:
    S, K = args.save_step, args.steps
    results = {"ref": None, "resume": {}}

    def fresh():
        model, opt = build(args.layout, world, args.experts)
        return model, opt, sm.schedulers(opt, S + K), sm.TrainState()

    if args.ref:
        model, opt, sched, ts = fresh()
        ckpt = sm.checkpointer(model, opt, sched, ts, args.ref, S)
        res = {"params": {}, "placements": {n: str(tuple(p.placements)) for n, p in model.named_parameters()
                                            if isinstance(p, DTensor)}}
        for s in range(1, S + K + 1):
            step(model, opt, sched, s)
            ts.step = s
            if s == S:
                ckpt.save(s)
                res["state"] = global_state(opt)
                res["bytes"] = opt.state_bytes()
            if s >= S:
                res["params"][s] = sm.full_params(model)
        ckpt.close()
        results["ref"] = res
    if args.load:
        with worker_jobs.no_codebook_learning():
            for base in args.load.split(","):
                model, opt, sched, ts = fresh()
                ckpt = sm.checkpointer(model, opt, sched, ts, base, S)
                assert ckpt.load(step=S)
                res = {"state": global_state(opt), "params": {S: sm.full_params(model)}}
                for s in range(S + 1, S + K + 1):
                    step(model, opt, sched, s)
                    res["params"][s] = sm.full_params(model)
                ckpt.close()
                results["resume"][os.path.basename(base)] = res
    torch.save(results, os.path.join(args.out, f"{args.tag}_r{rank}.pt"))


if __name__ == "__main__":
    sys.exit(worker_jobs.run(parser(), job))
