"""What Gefen's state costs (its registry entry's ``cost``, ``optim.state_cost.StateCost``): read by
``optim.state_size`` and the scale plan, held to the real optimizer by ``tests/unit/test_state_cost.py``."""

from __future__ import annotations

import math

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.state_cost import StateCost

__all__ = ["COST"]


def _param_bytes(sizes: tuple[int, ...], period: int, element_size: int) -> int:
    """Gefen's live state for one parameter shard: a uint8 code per element and ``gx.GEFEN_LIVE_BLOCK_FLOATS``
    fp32 per block. An empty shard holds nothing (Gefen keeps no tensors for it)."""
    numel = math.prod(sizes)
    return numel + 4 * gx.GEFEN_LIVE_BLOCK_FLOATS * (numel // period) if numel else 0


# The parameters' state, and the one fp32 [256] codebook per optimizer.
COST = StateCost(_param_bytes, optimizer_bytes=gx.K * 4, optimizer_tensors=gx.codebook_tensors)
