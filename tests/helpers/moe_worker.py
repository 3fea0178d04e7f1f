"""One rank of the mixture-of-experts runs (tests.helpers.moe_runs).

torchtitan 0.3.0's own Qwen3 MoE model (``moe_flavors.qwen3_moe``: 2 MoE
layers, dim 64, ``--experts`` routed experts of hidden 96, whose grouped
weights ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` are ``(E, out, in)``), sharded
by torchtitan's own code as its trainer does: the model config's sharding
set from the layout (``update_from_config``), then ``Module.parallelize``
(TP, EP) and ``apply_fsdp_to_decoder`` (FSDP on fsdp, the experts' FSDP on
efsdp with ``Shard(0)`` or, when efsdp x ep > experts, ``Shard(1)``); under
pipeline parallelism each stage keeps its layer (torchtitan's split keeps
the FQNs) and is parallelized alone. The layouts:

  one     a single process, plain tensors
  fsdp    EP 1 x FSDP over every rank (experts ``Shard(1)`` when ranks > experts)
  ep      EP 2 x efsdp (world / 2)
  ep4     EP 4 (efsdp 1)
  hsdp    HSDP 2 x (EP 2 x efsdp world / 4)
  tp      TP 2 x FSDP (world / 2), EP 1 (the experts cut by TP)
  eptp    EP 2 x TP 2 (EP over the TP ranks; efsdp = world / 2)
  pp      PP 2 x FSDP (world / 2), EP 1
  ppep    PP 2 x EP 2 (world 4)

The optimizers: GefenMuon for the attention's ``wo`` and the experts'
``w1_EFD`` and ``w3_EFD`` (NorMuon on; each expert's slice a Muon matrix),
Gefen for the rest (``w2_EDF`` among them: Gefen on experts too). Every
step's gradients are a fixed function of (step, name), each rank installing
the part of the global gradient its shard holds, so every layout sees
bit-identical gradients (no forward runs). A job does what its flags ask
and writes ``TAG_rRANK.pt`` into ``--out``:
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
from torch.distributed.tensor import DTensor

from gefen_titan import patches
from tests.helpers import worker_jobs

patches.apply_all()  # CPU / gloo meshes and FSDP2
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.trainer import Trainer

from gefen_titan.distributed.layout import local_box
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import ParamGroup
from gefen_titan.optim.kinds.gefen.options import GefenOptions
from gefen_titan.optim.kinds.gefen_muon.options import MuonOptions
from gefen_titan.recipe.moe_flavors import qwen3_moe
from tests.helpers import small_model as sm

MUON_PATTERN = r"^layers\.\d+\.(attention\.wo\.weight|moe\.routed_experts\.inner_experts\.w[13]_EFD)$"
MUON_KWARGS = {"lr": 0.02, "normuon": True}
MUON_BUCKET_MIB = 0.05  # several buckets; a grouped weight is never split between two

# layout -> torchtitan's degrees (the data-parallel shard degree takes what they leave of the world)
LAYOUTS = {"one": {}, "fsdp": {}, "ep": dict(ep=2), "ep4": dict(ep=4), "hsdp": dict(ep=2, rep=2),
           "tp": dict(tp=2), "eptp": dict(ep=2, tp=2), "pp": dict(pp=2), "ppep": dict(pp=2, ep=2)}


def degrees(layout: str, world: int) -> dict[str, int]:
    d = {"ep": 1, "tp": 1, "pp": 1, "rep": 1, **LAYOUTS[layout]}
    d["shard"] = world // (d["tp"] * d["pp"] * d["rep"])
    return d


def build_model(layout: str, world: int, experts: int) -> nn.Module:
    """The model, its sharding set from the layout as torchtitan's trainer sets it, from seed 0."""
    config = qwen3_moe("flex", num_experts=experts, top_k=2, dim=64, n_layers=2, n_heads=2, n_kv_heads=2,
                       head_dim=32, vocab=128, moe_hidden_dim=96)
    d = degrees(layout, world)
    config.update_from_config(config=Trainer.Config(
        training=TrainingConfig(disable_cuda_graphs=True),
        parallelism=ParallelismConfig(data_parallel_replicate_degree=d["rep"], data_parallel_shard_degree=d["shard"],
                                      tensor_parallel_degree=d["tp"], expert_parallel_degree=d["ep"],
                                      pipeline_parallel_degree=d["pp"], spmd_backend="partial_dtensor")))
    model = config.build()
    torch.manual_seed(0)
    with torch.no_grad():  # the same values at every layout, whatever torchtitan's init would draw
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 if p.dim() > 1 else torch.ones(p.shape))
    return model


def shard(model: nn.Module, layout: str, world: int) -> None:
    """torchtitan 0.3.0's sharding of the model at ``layout`` (see the module doc)."""
    if layout == "one":
        return
    d = degrees(layout, world)
    dims = ParallelDims(dp_replicate=d["rep"], dp_shard=d["shard"], cp=1, tp=d["tp"], pp=d["pp"], ep=d["ep"],
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    # Its groups are not ``worker_jobs.own``ed: FSDP2 keeps the (efsdp, ep) meshes it concatenates in a
    # process-wide cache, which a later job of the launch gets back, groups and all (destroying them
    # here made that job fail: "Could not resolve the process group"). A launch's few jobs leak them.
    if d["pp"] > 1:  # stage s keeps layer s (torchtitan's split keeps the FQNs)
        stage = dims.get_mesh("pp").get_local_rank()
        for key in [k for k in model.layers if int(k) != stage]:
            del model.layers[key]
        if stage == 0:
            model.norm = model.lm_head = None
        else:
            model.tok_embeddings = None
    if d["tp"] > 1 or d["ep"] > 1:
        model.parallelize(dims)
    replicate = ["dp_replicate"] if d["rep"] > 1 else []
    edp = dims.get_optional_mesh(replicate + ["efsdp"]) if d["ep"] > 1 else None
    apply_fsdp_to_decoder(model, dims.get_mesh(replicate + ["fsdp"]), torch.float32, torch.float32, d["pp"] > 1,
                          ep_degree=d["ep"], edp_mesh=edp)


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


def build(layout: str, world: int, experts: int, second_moment: str = "block"):
    model = build_model(layout, world, experts)
    shard(model, layout, world)
    if second_moment != "block":  # Gefen alone, experts included, with its factored second moment
        return model, sm.optimizer(model, blocking=BlockingOptions(max_tensor_parallel_degree=2),
                                   gefen=GefenOptions(second_moment=second_moment))
    opt = sm.optimizer(model, blocking=BlockingOptions(max_tensor_parallel_degree=2),
                       muon=MuonOptions(bucket_mib=MUON_BUCKET_MIB), param_groups=[
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
    for optim in opt.optimizers_of("GefenMuon"):
        specs, sched = gx.muon_sharded_step(optim).plan()
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
    ap.add_argument("--second-moment", default="block",
                    help="factored: Gefen alone (experts too) with optimizer.gefen.second_moment = factored")
    return ap


def job(args, rank: int, world: int) -> None:
    S, K = args.save_step, args.steps
    results = {"ref": None, "resume": {}}

    def fresh():
        model, opt = build(args.layout, world, args.experts, args.second_moment)
        return model, opt, sm.schedulers(opt, S + K), sm.TrainState()

    if args.ref:
        res, model = sm.reference_run(fresh, step, args.ref, S, K, global_state)
        res["placements"] = {n: str(tuple(p.placements)) for n, p in model.named_parameters()
                             if isinstance(p, DTensor)}
        results["ref"] = res
    if args.load:
        results["resume"] = sm.resumes(args.load.split(","), fresh, step, S, K, global_state)
    torch.save(results, os.path.join(args.out, f"{args.tag}_r{rank}.pt"))


if __name__ == "__main__":
    sys.exit(worker_jobs.run(parser(), job))
