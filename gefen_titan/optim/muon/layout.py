"""A GefenMuon matrix's pieces: which member of its copy holds which rows and columns.

The sharded step gathers a matrix's shards to one owner and sends each
member its slice of the update back, so it needs, per member, the global
rows and columns its local shard holds. Those come from the parameter's
placements alone (every member computes them alike, with no
communication), through ``gefen_titan.distributed.layout``, the one module
that places shards (``shard_indices``, ``shard_groups`` = its
``copy_groups``: re-exported here for the step's callers); this module only
cuts them into ``Piece`` s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gefen_titan.distributed.layout import LayoutError, copy_groups, shard_indices

__all__ = ["MuonLayoutError", "Piece", "as_slice", "shard_groups", "shard_indices"]


class MuonLayoutError(LayoutError):
    """A GefenMuon parameter whose placements the sharded step cannot assemble."""


shard_groups = copy_groups


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
