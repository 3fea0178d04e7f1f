"""What a rank's optimizers hold: the bytes of their state over the parameter elements.

The container logs it once after the first step (Gefen allocates its state
there) and benchmarks read it (``GefenOptimizersContainer.state_bytes``),
so the count is one function: every tensor in every optimizer's
per-parameter state (local shards of DTensors), plus the tensors a kind
keeps per optimizer (Gefen's and GefenMuon's codebooks), which its registry
entry's ``cost`` names (``optim.state_cost``): this module names no kind.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from gefen_titan.distributed import local
from gefen_titan.optim import registry

__all__ = ["state_bytes"]


def state_bytes(optimizers: list[Optimizer]) -> tuple[int, int]:
    """(optimizer state bytes, parameter elements) held by this rank."""
    total = numel = 0
    for optim in optimizers:
        for group in optim.param_groups:
            for p in group["params"]:
                numel += local(p).numel()
                for value in optim.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        total += local(value).nbytes
        spec = registry.spec_of(optim)
        if spec is not None and spec.cost is not None:
            total += sum(local(t).nbytes for t in spec.cost.optimizer_tensors(optim))
    return total, numel
