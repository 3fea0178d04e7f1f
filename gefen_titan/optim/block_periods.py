"""Which block periods a parameter may have, and which one Gefen's scoring picks.

Agreed blocking (``gefen_titan.optim.blocking``) must never let a block cross
a shard cut at any layout the run may resume at, so a parameter's candidate
periods are the divisors of its *row unit* (the gcd of its last dimension and
of every last-dim cut of its live placements and of the tensor-parallel
degrees the recipe allows). These rules need no communication and no
gradient, only shapes and placements, so they live apart from the agreement's
collectives: the agreement, the load's check that a saved period fits the
live layout (``optim.checkpointing.sharded``) and the offline AdamW -> Gefen
conversion (``ckpt_tools.convert``) apply the same ones.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from gefen_titan.distributed.layout import last_dim_cuts
from gefen_titan.errors import UserError
from gefen_titan.optim import gefenx as gx

__all__ = ["BlockingError", "candidate_periods", "check_period_fits", "period_from_sums", "row_unit"]


class BlockingError(UserError, RuntimeError):
    """Agreed blocking cannot be set up for this model, mesh or recipe."""


def row_unit(fqn: str, param: torch.Tensor, max_tp_degree: int = 1) -> int:
    """The largest block that no last-dim cut of any allowed layout crosses.

    Raises ``BlockingError`` for layouts whose local shard is not a box of
    whole rows of that unit (a strided shard of the last dim).
    """
    shape = tuple(param.shape)
    last = shape[-1]
    unit = last
    if isinstance(param, DTensor):
        placements = tuple(param.placements)
        dims = []
        for i, pl in enumerate(placements):
            if pl.is_shard() and pl.dim % len(shape) == len(shape) - 1:
                if type(pl) is not Shard:
                    raise BlockingError(
                        f"{fqn}: placements {placements} shard the last dimension with a strided "
                        "layout; agreed blocking needs plain Shard placements on the last dimension"
                    )
                dims.append(i)
        if dims:
            mesh_shape = tuple(param.device_mesh.shape)
            unit = math.gcd(unit, *last_dim_cuts(shape, mesh_shape, placements, dims))
    for t in range(2, max_tp_degree + 1):
        if max_tp_degree % t == 0:
            unit = math.gcd(unit, *last_dim_cuts(shape, (t,), (Shard(len(shape) - 1),), [0]))
    return unit


def candidate_periods(unit: int) -> list[int]:
    """Ascending divisors of the row unit (the unit itself included)."""
    small, large = [], []
    for i in range(1, math.isqrt(unit) + 1):
        if unit % i == 0:
            small.append(i)
            if i != unit // i:
                large.append(unit // i)
    return small + large[::-1]


def period_from_sums(candidates: list[int], sums: torch.Tensor, numel: int, unit: int) -> int:
    """Gefen's period among ``candidates`` from the global ``block_variance_sums``.

    Gefen's error of a candidate is sqrt(mean over blocks of the within-block
    variance of grad²); its own scoring (``gefenx.finalize_period``) and
    memory-safe fallback (the whole row unit) pick the period. Shared by the
    agreement and by ``gefen_titan.ckpt_tools.convert`` (which scores the AdamW
    second moment instead of a gradient's square).
    """
    results = [(p, math.sqrt(float(sums[i]) / (numel // p))) for i, p in enumerate(candidates)]
    best = gx.finalize_period(results)
    if best == 1 and gx.fallback_enabled():
        best = unit if unit >= 8 else 1  # gefen-x's fallback: the whole row
    return best


def check_period_fits(fqn: str, param: torch.Tensor, period: int) -> str | None:
    """None if blocks of ``period`` fit the param's live layout, else why not."""
    if period == 1:
        return None
    if param.dim() < 2:
        return f"{fqn}: period {period} on a {param.dim()}-D parameter (agreed blocking uses 1)"
    try:
        unit = row_unit(fqn, param)
    except BlockingError as e:
        return str(e)
    if unit % period:
        return (
            f"{fqn}: saved block period {period} crosses a shard cut of the live layout "
            f"{tuple(param.placements) if isinstance(param, DTensor) else ()} (row unit {unit}); the run that "
            "wrote the checkpoint did not declare this tensor-parallel degree: set "
            "optimizer.blocking.max_tensor_parallel_degree there, or resume at a layout whose "
            "last-dim cuts are multiples of the period"
        )
    return None
