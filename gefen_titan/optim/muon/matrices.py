"""A GefenMuon parameter's matrices and their pieces: which member of its copy holds which rows and columns.

A 2-D parameter is one Muon matrix; a grouped experts' weight ``(E, out,
in)`` (torchtitan's MoE) is E of them, each expert's ``(out, in)`` slice.
The sharded step gathers a matrix's shards to one owner and sends each
holder its slice of the update back, so it needs, per holder, the global
rows and columns its local shard holds (and, for an expert, where the
expert lies in the holder's shard). Those come from the parameter's
placements alone (every member computes them alike, with no
communication), through ``gefen_titan.distributed.layout``, the one module
that places shards (``shard_indices``, ``shard_groups`` = its
``copy_groups``: re-exported here for the step's callers); this module only
cuts them into matrices and ``Piece`` s (``matrix_cuts``), for the step and
for the scale plan alike.

* A 2-D matrix's pieces are every member of the copy (an empty shard too:
  any member can own it).
* An expert's pieces are the members whose shard holds part of it: under
  EP ``Shard(0)`` (efsdp ``Shard(0)``, torchtitan's default) a whole expert
  lies on one rank, which then orthogonalizes it with no exchange; under
  efsdp ``Shard(1)`` its rows lie on several, which the exchange brings
  together as for a dense matrix.
* A copy of one member (one rank, or a mesh of one) holds every matrix
  whole: no pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gefen_titan.distributed.layout import LayoutError, copy_groups, shard_box, shard_indices

__all__ = ["MatrixCut", "MuonLayoutError", "Piece", "as_slice", "is_grouped", "matrix_cuts", "shard_groups",
           "shard_indices"]


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


def is_grouped(shape: tuple[int, ...]) -> bool:
    """A grouped experts' weight ``(E, out, in)``: one Muon matrix per expert."""
    return len(shape) == 3


@dataclass(frozen=True)
class MatrixCut:
    """One Muon matrix of a parameter and who holds which part of it (see the module doc)."""

    fqn: str  # the parameter's FQN; an expert's is ``fqn[e]``
    shape: tuple[int, int]
    expert: int  # the expert's index in a grouped weight; -1 for a 2-D parameter
    pieces: tuple[Piece, ...]  # its holders in this copy, in the copy's order; () held whole
    local_index: tuple[int, ...]  # per piece: the expert's index in that holder's shard (0 for a matrix)

    def index_of(self, rank: int) -> int:
        """This rank's piece, or -1 when it holds none of the matrix."""
        return next((i for i, pc in enumerate(self.pieces) if pc.rank == rank), -1)


def matrix_cuts(fqn: str, shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements,
                members: list[tuple[int, tuple[int, ...]]]) -> list[MatrixCut]:
    """The Muon matrices of a parameter of ``shape`` and their pieces over one copy's ``members``
    ((global rank, mesh coordinate), from ``shard_groups``; a copy of one member holds it whole)."""
    shape = tuple(int(n) for n in shape)
    if len(shape) not in (2, 3):
        raise MuonLayoutError(f"{fqn}: GefenMuon steps matrices and grouped experts (E, out, in), not {shape}")
    matrix = shape[-2:]
    boxes = [(rank, shard_box(shape, mesh_shape, placements, coord)) for rank, coord in members] \
        if len(members) > 1 else []

    def piece(rank, box) -> Piece:
        rows, cols = box.offsets[-2], box.offsets[-1]
        return Piece(rank, slice(rows, rows + box.sizes[-2]), slice(cols, cols + box.sizes[-1]),
                     box.sizes[-2], box.sizes[-1])

    if len(shape) == 2:
        pieces = tuple(piece(r, b) for r, b in boxes)
        return [MatrixCut(fqn, matrix, -1, pieces, (0,) * len(pieces))]
    out = []
    for e in range(shape[0]):
        holders = [(r, b) for r, b in boxes
                   if b.offsets[0] <= e < b.offsets[0] + b.sizes[0] and b.sizes[1] and b.sizes[2]]
        out.append(MatrixCut(f"{fqn}[{e}]", matrix, e, tuple(piece(r, b) for r, b in holders),
                             tuple(e - b.offsets[0] for _, b in holders)))
    return out
