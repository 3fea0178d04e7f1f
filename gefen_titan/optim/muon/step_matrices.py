"""The matrices one rank's GefenMuon step handles, in step order, with what the step needs of each.

``matrices.matrix_cuts`` says which pieces of a parameter's matrices each
member of its copy holds (placements only, shared with the scale plan); this
module pairs them with what the step carries along (the optimizer and its
param group, the owner the schedule picks, where an expert lies in this
rank's shard) and describes each as the schedule sees it (``matrix_spec``).
Every member of a copy builds the same list, which is what lets the
schedule's buckets and owners agree without communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from gefen_titan.distributed import rank_and_world
from gefen_titan.distributed.layout import LayoutError, local_box
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.muon.matrices import MuonLayoutError, Piece, matrix_cuts, shard_groups
from gefen_titan.optim.muon.schedule import MatrixSpec

__all__ = ["StepMatrix", "matrix_spec", "step_matrices"]


@dataclass
class StepMatrix:
    """One matrix of the step: its piece on this rank and, once the schedule is made, its owner."""

    fqn: str  # the parameter's; an expert's is ``fqn[e]``
    param_fqn: str
    param: torch.Tensor
    optim: Optimizer
    group: dict
    shape: tuple[int, int]
    pieces: tuple[Piece, ...]  # its holders in this rank's copy; empty: the whole matrix is here
    me: int  # index of this rank's piece (0 when whole); -1: this rank holds none of it
    local_expert: int = -1  # an expert's index in this rank's shard of the grouped weight; -1: a 2-D parameter
    owner: int = -1


def step_matrices(optimizers: list[Optimizer]) -> list[StepMatrix]:
    """Every matrix of every parameter, in step order: a grouped weight's experts one after another,
    those this rank holds none of included (every member of a copy plans the same list)."""
    rank, _ = rank_and_world()
    found = []
    for optim in optimizers:
        for fqn, p, group in gx.named_params(optim):
            shape = tuple(p.shape)
            if isinstance(p, DTensor):
                mine = next((g for g in shard_groups(p) if any(r == rank for r, _ in g)), None)
                if mine is None:
                    raise MuonLayoutError(f"{fqn}: this rank holds a parameter of a mesh it is not in")
                try:
                    offset = local_box(p).offsets[0]  # where this rank's experts start
                except LayoutError as e:
                    raise MuonLayoutError(f"{fqn}: {e}") from e
                cuts = matrix_cuts(fqn, shape, tuple(p.device_mesh.shape), p.placements, mine)
            else:
                offset, cuts = 0, matrix_cuts(fqn, shape, (1,), (), [])
            for c in cuts:
                if c.pieces:
                    me = c.index_of(rank)
                    local_expert = c.local_index[me] if me >= 0 and c.expert >= 0 else -1
                else:
                    me, local_expert = 0, (c.expert - offset if c.expert >= 0 else -1)
                found.append(StepMatrix(c.fqn, fqn, p, optim, group, c.shape, c.pieces, me, local_expert))
    return found


def matrix_spec(m: StepMatrix) -> MatrixSpec:
    """``m`` as the schedule sees it: its shape, Newton-Schulz steps and pieces' ranks and sizes."""
    return MatrixSpec(m.fqn, m.shape, int(m.group["ns_steps"]),
                      tuple(pc.rank for pc in m.pieces), tuple(pc.numel for pc in m.pieces),
                      tuple(pc.nrows for pc in m.pieces), m.param_fqn if m.param_fqn != m.fqn else "")
