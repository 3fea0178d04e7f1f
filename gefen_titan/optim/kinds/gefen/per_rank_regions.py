"""Where each rank's Gefen state lives in a parameter, and how to re-block it.

Gefen steps the local shard of an FSDP2 parameter as a flat run of elements
cut into blocks of ``period`` (chosen per rank on step 1). For ``Shard(0)``
(optionally under ``Replicate`` dims: HSDP) a local shard is one contiguous
run ``[start, start + length)`` of the row-major flattened parameter, so a
rank's state is fully placed by (start, length, period). Other placements
(TP's row/column shards, ``_StridedShard`` of FSDP x TP) make a shard a
rectangle, not a run; we refuse them rather than mis-place state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from gefen_titan.distributed.layout import local_box
from gefen_titan.errors import UserError

__all__ = ["Region", "param_region", "target_period", "UnsupportedLayout"]


class UnsupportedLayout(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Region:
    """A rank's slice of a parameter: label = its coordinate on the shard dim."""

    label: int
    nshards: int
    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def param_region(fqn: str, param: torch.Tensor) -> tuple[Region, tuple[int, ...]]:
    """(region, local shape) of this rank's shard of ``param``."""
    numel = param.numel()
    if not isinstance(param, DTensor):
        return Region(0, 1, 0, numel), tuple(param.shape)
    shard_dims = [i for i, pl in enumerate(param.placements) if not isinstance(pl, Replicate)]
    for i in shard_dims:
        pl = param.placements[i]
        if type(pl) is not Shard or pl.dim != 0:
            raise UnsupportedLayout(
                f"{fqn}: placements {tuple(param.placements)} are not supported by the "
                "Gefen checkpoint adapter (only Shard(0) FSDP, optionally with Replicate "
                "dims for HSDP). Tensor/context parallel meshes: train with "
                "tensor_parallel_degree = 1, or save with checkpoint.exclude_from_loading "
                "= ['optimizer'] on resume."
            )
    if len(shard_dims) > 1:
        raise UnsupportedLayout(
            f"{fqn}: parameter is sharded on {len(shard_dims)} mesh dims; only one Shard(0) dim is supported")
    box = local_box(param)  # where the shard lies: the layout module's, checked against the local tensor
    if not shard_dims:
        return Region(0, 1, 0, numel), box.sizes
    dim = shard_dims[0]
    coord = param.device_mesh.get_coordinate()
    label = coord[dim] if coord is not None else 0
    nshards = param.device_mesh.size(dim)
    start, length = box.flat_run(tuple(param.shape))  # Shard(0) alone: whole rows, one run
    return Region(label, nshards, start, length), box.sizes


def target_period(start: int, length: int, pieces: list[tuple[int, int]], min_period: int = 256) -> tuple[int, bool]:
    """Period for a target run built from source runs; True if exact.

    ``pieces`` holds (source start, source period) of every source run the
    target overlaps. A target period ``d`` puts every target block inside one
    source block (so each block's ``vmean`` carries over per element) iff
    ``d`` divides the target length, each source period, and each source's
    offset from the target start modulo its period. The largest such ``d`` is
    their gcd. If that is tiny (state would grow to 8 B/elem) and the sources
    were not already that fine, take the largest divisor of the length that is
    no larger than the finest source period instead; block means then average
    ``vmean`` over several source blocks.
    """
    if length == 0:
        return 0, True
    g = length
    finest = None
    for src_start, period in pieces:
        g = math.gcd(g, period, (src_start - start) % period)
        finest = period if finest is None else min(finest, period)
    finest = finest or length
    if g >= min(finest, min_period):
        return g, True
    best = 1
    for d in range(1, int(math.isqrt(length)) + 1):
        if length % d == 0:
            for cand in (d, length // d):
                if cand <= finest and cand > best:
                    best = cand
    return best, False
