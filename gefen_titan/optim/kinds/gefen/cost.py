"""What Gefen's state costs (its registry entry's ``cost``, ``optim.state_cost.StateCost``): read by
``optim.state_size`` and the scale plan, held to the real optimizer by ``tests/unit/test_state_cost.py``.

Two rules, by ``[optimizer.gefen] second_moment`` (``COST.under(options)``; ``COST`` itself is the
default's, factored): ``"block"`` keeps per block
the magnitude, ``vmean`` and gefen-x's two per-step scratch floats; ``"factored"`` keeps, for a parameter of
two dims or more, the magnitude per block (no scratch: the factored step keeps none) and one fp32 per row
and per column of every matrix of the shard (``optim.kinds.gefen.factored``).
"""

from __future__ import annotations

import math
from typing import Any

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.state_cost import StateCost

__all__ = ["BLOCK_COST", "COST", "FACTORED_COST"]


def _param_bytes(sizes: tuple[int, ...], period: int, element_size: int) -> int:
    """Gefen's live state for one parameter shard: a uint8 code per element and ``gx.GEFEN_LIVE_BLOCK_FLOATS``
    fp32 per block. An empty shard holds nothing (Gefen keeps no tensors for it)."""
    numel = math.prod(sizes)
    return numel + 4 * gx.GEFEN_LIVE_BLOCK_FLOATS * (numel // period) if numel else 0


def _factored_param_bytes(sizes: tuple[int, ...], period: int, element_size: int) -> int:
    """A factored parameter's shard: a code per element, its magnitude per block, an fp32 per row and per
    column (``factor_shapes``); an empty shard keeps its rows and columns (one of them may be whole)."""
    if len(sizes) < 2:
        return _param_bytes(sizes, period, element_size)
    numel = math.prod(sizes)
    factors = 4 * (math.prod(sizes[:-1]) + math.prod(sizes[:-2]) * sizes[-1])
    return (numel + 4 * (numel // period) if numel else 0) + factors


def _for_options(options: Any) -> StateCost:
    return FACTORED_COST if options.resolved_second_moment() == "factored" else BLOCK_COST


# The parameters' state, and the one fp32 [256] codebook per optimizer.
FACTORED_COST = StateCost(_factored_param_bytes, optimizer_bytes=gx.K * 4, optimizer_tensors=gx.codebook_tensors)
BLOCK_COST = StateCost(_param_bytes, optimizer_bytes=gx.K * 4, optimizer_tensors=gx.codebook_tensors)
# The registry entry's: the default options' rule (second_moment "auto": factored under agreed blocking),
# and ``under(options)`` for others. A plan read without options is the default run's.
COST = StateCost(_factored_param_bytes, optimizer_bytes=gx.K * 4, optimizer_tensors=gx.codebook_tensors,
                 for_options=_for_options)
