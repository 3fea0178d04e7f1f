"""Where each shard of a GefenMuon matrix lies: shard groups, the indices a shard holds, pieces.

The sharded step gathers a matrix's shards to one owner and sends each
member its slice of the update back, so it needs, per member, the global
rows and columns its local shard holds, from the DTensor's placements
alone (every member computes them alike, with no communication).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["MuonLayoutError", "Piece", "as_slice", "shard_groups", "shard_indices"]


class MuonLayoutError(RuntimeError):
    """A GefenMuon parameter whose placements the sharded step cannot assemble."""


def shard_indices(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements, coord: tuple[int, ...]
                  ) -> list[torch.Tensor]:
    """Per tensor dim, the global indices the shard at mesh coordinate ``coord`` holds.

    DTensor shards a tensor by applying its placements left to right, each
    splitting one dim of what the previous ones left (``_StridedShard`` is
    FSDP x TP's right-to-left split written that way), so a shard is the
    product of one index list per dim; those lists come from the same split
    applied to ``arange`` of the dim.
    """
    ix = [torch.arange(n) for n in shape]
    for pl in placements:
        if not pl.is_replicate() and type(pl) not in (Shard, _StridedShard):
            raise MuonLayoutError(f"placement {pl} (only Shard, _StridedShard and Replicate hold a parameter)")
    order = list(enumerate(placements))
    if any(type(pl) is _StridedShard for pl in placements):
        # _StridedShard is how FSDP2 over TP records its layout: TP cut first,
        # then FSDP2's torch.chunk of each TP shard. At uneven sizes DTensor's
        # own strided split differs from what FSDP2 holds (tests/unit/
        # test_muon_layout.py compares with real fully_shard shards), so the
        # cuts are replayed as FSDP2 made them: right to left, each a plain chunk.
        order.reverse()
    for mesh_dim, pl in order:
        if pl.is_replicate():
            continue
        d = pl.dim % len(shape)
        pieces, _ = Shard(0)._split_tensor(ix[d], mesh_shape[mesh_dim], with_padding=False)  # noqa: SLF001
        ix[d] = pieces[coord[mesh_dim]]
    return ix


def shard_groups(param: torch.Tensor) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Every shard group of a DTensor parameter: lists of (global rank, mesh coordinate).

    A group is one copy of the matrix, cut over the mesh dims that shard it,
    at one coordinate of the ``Replicate`` dims; its members are in
    row-major order of their coordinates on the sharding dims.
    """
    mesh = param.device_mesh
    ranks = mesh.mesh
    shape = tuple(mesh.shape)
    sharding = [d for d, pl in enumerate(param.placements) if not pl.is_replicate()]
    replicated = [d for d in range(len(shape)) if d not in sharding]
    groups = []
    for rep in itertools.product(*(range(shape[d]) for d in replicated)):
        members = []
        for sh in itertools.product(*(range(shape[d]) for d in sharding)):
            coord = [0] * len(shape)
            for d, i in itertools.chain(zip(replicated, rep), zip(sharding, sh)):
                coord[d] = i
            members.append((int(ranks[tuple(coord)]), tuple(coord)))
        groups.append(members)
    return groups


def as_slice(idx: torch.Tensor) -> slice | torch.Tensor:
    """A contiguous run of indices as a slice (a view), otherwise the indices."""
    n = idx.numel()
    if n == 0:
        return slice(0, 0)
    first = int(idx[0])
    if int(idx[-1]) - first == n - 1 and (n < 3 or bool((idx.diff() == 1).all())):
        return slice(first, first + n)
    return idx


@dataclass
class Piece:
    """One member's shard of a matrix: its global rank and the rows and columns it holds."""

    rank: int
    rows: slice | torch.Tensor
    cols: slice | torch.Tensor
    nrows: int
    ncols: int

    @property
    def numel(self) -> int:
        return self.nrows * self.ncols

    def take(self, full: torch.Tensor) -> torch.Tensor:
        rows = full[self.rows]
        return rows[:, self.cols] if isinstance(self.cols, slice) else rows.index_select(1, self.cols)

    def put(self, full: torch.Tensor, piece: torch.Tensor) -> None:
        if isinstance(self.rows, slice) and isinstance(self.cols, slice):
            full[self.rows, self.cols] = piece
        else:
            rows = torch.arange(full.shape[0])[self.rows] if isinstance(self.rows, slice) else self.rows
            cols = torch.arange(full.shape[1])[self.cols] if isinstance(self.cols, slice) else self.cols
            full[rows.unsqueeze(1), cols.unsqueeze(0)] = piece
