"""What a rank's optimizers hold: the bytes of their state over the parameter elements.

The container logs it once after the first step (Gefen allocates its state
there) and benchmarks read it (``GefenOptimizersContainer.state_bytes``),
so the count is one function: every tensor in every optimizer's
per-parameter state (local shards of DTensors), plus Gefen's and
GefenMuon's per-optimizer codebooks.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from gefen_titan.distributed import local
from gefen_titan.optim import gefenx as gx

__all__ = ["state_bytes"]


def state_bytes(optimizers: list[Optimizer]) -> tuple[int, int]:
    """(optimizer state bytes, parameter elements) held by this rank."""
    total = numel = 0
    for optim in optimizers:
        for group in optim.param_groups:
            for p in group["params"]:
                numel += local(p).numel()
        if gx.is_gefen_family(optim):
            total += sum(local(t).nbytes for t in gx.state_tensors(optim))
            continue
        for group in optim.param_groups:
            for p in group["params"]:
                for value in optim.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        total += local(value).nbytes
    return total, numel
