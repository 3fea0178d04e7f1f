"""The small Llama-like model and its training set-up, shared by the torchrun
test workers (``agreed_worker``, ``reshard_worker``).

An embedding, MLP blocks (RMSNorm, w1, w2) in a ``ModuleDict``, a final norm,
optionally a tiny ``gate`` matrix, and an output projection; FSDP2 over a
``dp_shard`` (or ``dp_replicate`` x ``dp_shard``) CPU mesh; real Gefen through
``GefenOptimizersContainer``, torchtitan's LR schedulers and our
``GefenCheckpointManager``. Each worker picks its sizes; everything else is
the same for both, so a fix to the set-up reaches both.

The parameters' values depend on the order of construction under
``torch.manual_seed(0)`` (``build_model``): the reference and resumed runs of
a test, and every layout of one, must build the same model, so the order of
the modules below is part of what the tests compare.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from gefen_titan import patches

patches.apply_all()  # CPU / gloo FSDP2, before torchtitan's modules are used
from torchtitan.components.optimizer import LRSchedulersContainer

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.optim.container import GefenOptimizersContainer
from tests.helpers import worker_jobs


@dataclass(frozen=True)
class Sizes:
    vocab: int
    dim: int
    hidden: int
    layers: int = 2
    gate_rows: int = 0  # > 0: a (gate_rows x dim) matrix, e.g. 2 rows for an empty shard at 3 ranks


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, sizes: Sizes):
        super().__init__()
        self.tok_embeddings = nn.Embedding(sizes.vocab, sizes.dim)
        # A ModuleDict, as torchtitan's models: a pipeline split deletes
        # entries and the remaining FQNs stay those of the whole model.
        self.layers = nn.ModuleDict({str(i): Block(sizes.dim, sizes.hidden) for i in range(sizes.layers)})
        self.norm = nn.RMSNorm(sizes.dim)
        if sizes.gate_rows:
            self.gate = nn.Linear(sizes.dim, sizes.gate_rows, bias=False)
        self.output = nn.Linear(sizes.dim, sizes.vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


def build_model(sizes: Sizes) -> Net:
    """The model from seed 0: the same parameters in every run and layout."""
    torch.manual_seed(0)
    return Net(sizes)


def dp_mesh(world: int, replicate: int = 1) -> DeviceMesh:
    """FSDP's mesh over the world: ``dp_shard``, or ``dp_replicate`` x
    ``dp_shard`` (HSDP) for ``replicate`` > 1; destroyed when the job ends."""
    if replicate > 1:
        mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    worker_jobs.own(mesh)
    return mesh


def shard(model: Net, mesh: DeviceMesh, offload: bool = False) -> None:
    """FSDP2 as torchtitan applies it: each block, then the rest of the model; ``offload``: with
    torchtitan's ``--training.enable_cpu_offload`` policy (host-resident shards and optimizer step;
    unpinned, as ``patches.cpu_offload`` builds it on CPU hosts)."""
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


def optimizer(model: nn.Module, **config) -> GefenOptimizersContainer:
    """The container both workers train with; ``config`` adds to or replaces these settings."""
    settings = {"name": "Gefen", "lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, **config}
    return GefenOptimizersContainer.Config(**settings).build(model_parts=[model])


def schedulers(opt: GefenOptimizersContainer, steps: int) -> LRSchedulersContainer:
    return LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=None, min_lr_factor=0.1).build(
        optimizers=opt, training_steps=steps)


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def checkpointer(model, opt, sched, train_state, folder: str, interval: int,
                 async_mode: str = "disabled") -> GefenCheckpointManager:
    """Our manager for the model, optimizer, schedulers and train state, under ``folder``/ckpt."""
    ckpt = GefenCheckpointManager.Config(
        enable=True, folder="ckpt", interval=interval, last_save_model_only=False, keep_latest_k=0,
        async_mode=async_mode,
    ).build(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
            states={"train_state": train_state}, sd_adapter=None, base_folder=folder)
    worker_jobs.own(ckpt.pg)  # torchtitan's async-save group (async modes; None otherwise)
    return ckpt


def full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (gathered from the shards of a DTensor: a collective)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


# ------------------------------------------------------------------ runs of any optimizer kind
# What the workers (agreed_worker: Gefen; muon_worker: GefenMuon; moe_worker: experts) do alike.
# ``fresh()`` -> (model, optimizers, schedulers, train state) built afresh; ``step(model, opt, sched, s)``
# takes training step s; ``global_state(opt)`` is the worker's view of the optimizer's state.
def resumes(bases: list[str], fresh, step, save_step: int, steps: int, global_state) -> dict[str, dict]:
    """Each checkpoint folder of ``bases`` loaded at ``save_step`` by a fresh run that trains ``steps``
    more: per folder name, the state right after the load and the parameters at every step from it."""
    out = {}
    with worker_jobs.no_codebook_learning():
        for base in bases:
            model, opt, sched, ts = fresh()
            ckpt = checkpointer(model, opt, sched, ts, base, save_step)
            assert ckpt.load(step=save_step)
            res = {"state": global_state(opt), "params": {save_step: full_params(model)}}
            for s in range(save_step + 1, save_step + steps + 1):
                step(model, opt, sched, s)
                res["params"][s] = full_params(model)
            ckpt.close()
            out[os.path.basename(base)] = res
    return out


def bad_checkpoint_case(base: str, fresh, step, save_step: int, snapshot) -> dict:
    """A run one step in tries to load the checkpoint under ``base`` at ``save_step``: the error it got
    (None: it loaded) and ``snapshot(opt)`` of its optimizer before and after the try."""
    model, opt, sched, ts = fresh()
    step(model, opt, sched, 1)
    ckpt = checkpointer(model, opt, sched, ts, base, save_step)
    before = snapshot(opt)
    try:
        ckpt.load(step=save_step)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    out = {"error": error, "before": before, "after": snapshot(opt)}
    ckpt.close()
    return out


def reference_run(fresh, step, folder: str, save_step: int, steps: int, global_state) -> tuple[dict, nn.Module]:
    """A run of ``save_step + steps`` steps that saves at ``save_step`` under ``folder``: (its state at the
    save, state bytes and parameters from the save on, the model)."""
    model, opt, sched, ts = fresh()
    ckpt = checkpointer(model, opt, sched, ts, folder, save_step)
    res: dict = {"params": {}}
    for s in range(1, save_step + steps + 1):
        step(model, opt, sched, s)
        ts.step = s
        if s == save_step:
            ckpt.save(s)
            res["state"] = global_state(opt)
            res["bytes"] = opt.state_bytes()
        if s >= save_step:
            res["params"][s] = full_params(model)
    ckpt.close()
    return res, model
