"""What GefenMuon's state costs (its registry entry's ``cost``, ``optim.state_cost.StateCost``): read by
``optim.state_size`` and the scale plan, held to the real optimizer by ``tests/unit/test_state_cost.py``."""

from __future__ import annotations

import math

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.state_cost import StateCost

__all__ = ["COST"]


def _param_bytes(sizes: tuple[int, ...], period: int, element_size: int) -> int:
    """GefenMuon's state for one parameter shard: a uint8 code per element (``m_codebook``), an fp32
    magnitude per block (``m_magnitude``), NorMuon's fp32 per row of the shard (``normuon_v``, with
    ``normuon`` on as GefenMuonHybrid and the muon recipes have it; gefen-x defaults it off, which keeps
    no rows). An empty shard holds nothing."""
    numel = math.prod(sizes)
    return numel + 4 * (numel // period) + gx.NORMUON_ROW_BYTES * (numel // sizes[-1]) if numel else 0


# The parameters' state, and the one fp32 [256] codebook per optimizer (Gefen's attribute).
COST = StateCost(_param_bytes, optimizer_bytes=gx.K * 4, optimizer_tensors=gx.codebook_tensors)
