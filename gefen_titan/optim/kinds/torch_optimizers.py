"""torch's own AdamW and Adam as registry entries: no state of their own shape (torchtitan's flat
per-parameter state dict checkpoints them), only their group keys and what their state costs."""

from __future__ import annotations

import inspect

import torch
from torch.optim import Optimizer

from gefen_titan.optim.registry import OptimizerSpec
from gefen_titan.optim.state_cost import StateCost, dense

__all__ = ["specs"]


def torch_optimizer(cls: type[Optimizer], cost: StateCost) -> OptimizerSpec:
    return OptimizerSpec(name=cls.__name__, factory=cls, owns=lambda optim: type(optim) is cls,
                         group_keys=tuple(n for n in inspect.signature(cls).parameters if n != "params"), cost=cost)



def specs() -> list[OptimizerSpec]:
    """AdamW's and Adam's entries: exp_avg and exp_avg_sq like the parameter, and an fp32 step
    (amsgrad's max_exp_avg_sq is not counted)."""
    return [torch_optimizer(torch.optim.AdamW, dense(2, 4)), torch_optimizer(torch.optim.Adam, dense(2, 4))]
