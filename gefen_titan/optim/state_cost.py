"""What an optimizer kind's state costs: its registry entry's ``cost`` (``optim.registry.OptimizerSpec``).

Two readers need the bytes of a kind's state and must not name the kind:
``optim.state_size`` counts a built optimizer's live state (the container
logs it, benchmarks read it), and the scale plan (``benchmarks/scale.py``)
computes it for models it never allocates, from each parameter shard's
size and block period alone. Each kind states both once, in its own files
(Gefen and GefenMuon: the gefen-x layouts in ``optim.gefenx``; torch's
optimizers: ``dense`` in the registry), and ``tests/unit/test_state_cost.py``
holds every registered rule to what the real optimizer holds.
This module names no kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["StateCost", "dense"]


def _no_tensors(optim: Optimizer) -> Iterable[torch.Tensor]:
    return ()


@dataclass(frozen=True)
class StateCost:
    """One kind's state bytes: by rule for the plan, and the tensors it keeps outside ``optim.state``."""

    param_bytes: Callable[[tuple[int, ...], int, int], int]
    """(a parameter's local shard sizes, its block period, its element size) -> the bytes of every tensor the
    optimizer keeps for that shard between steps (scratch included; an empty shard may hold some)."""
    optimizer_bytes: int = 0
    """Bytes one optimizer keeps beyond its parameters' state (a codebook), on every rank."""
    optimizer_tensors: Callable[[Optimizer], Iterable[torch.Tensor]] = _no_tensors
    """Those tensors of a built optimizer (what ``optim.state_size`` adds to its ``optim.state``)."""
    for_options: Callable[[Any], StateCost] | None = None
    """The cost under the kind's options table (its ``OptionsTable``), where an option changes what the
    state holds (Gefen's ``second_moment``); None: the same under every option."""

    def under(self, options: Any) -> StateCost:
        """This kind's cost with ``options`` (its options table; None: the defaults)."""
        return self if self.for_options is None or options is None else self.for_options(options)


def dense(like_param: int, scalar_bytes: int) -> StateCost:
    """A torch optimizer's per-parameter state: ``like_param`` tensors of the parameter's shape and dtype, and
    ``scalar_bytes`` of scalar tensors (AdamW and Adam: ``exp_avg``, ``exp_avg_sq`` and an fp32 ``step``:
    ``dense(2, 4)``), on every rank, an empty shard's included."""
    return StateCost(lambda sizes, period, element_size: like_param * math.prod(sizes) * element_size
                     + scalar_bytes)
