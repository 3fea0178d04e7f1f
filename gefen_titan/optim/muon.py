"""GefenMuon's sharded step: momentum on the parameter's shards, Newton-Schulz on one owner.

gefen-x's GefenMuon gathers every full gradient on every rank and keeps the
full-matrix quantized momentum everywhere (``sharded_mode="exact"``), or on
an owner chosen by ``index % world`` on 1-D meshes only. gefen-titan never
runs its ``step()``: ``ShardedMuonStep`` (the ``step()`` of the GefenMuon
the registry builds, ``gefen_state.ShardedGefenMuon``) drives gefen-x's own pieces
(``gefen_state.muon_*``) so that each rank keeps only its share of the
state and the arithmetic is gefen-x's, bit for bit, at every layout. Per
GefenMuon matrix, in the same order on every rank:

1. momentum on the local shard: the quantized codes, block magnitudes and
   (with NorMuon) the rows of the shard live where the parameter's shard
   lives. Agreed blocking's periods divide the row length and every allowed
   column cut, so every block lies inside one shard and the shard's
   momentum equals the full matrix's on those elements;
2. the ranks that hold the matrix's shards, one copy of it (its *shard
   group*: the mesh's ranks at this rank's coordinates on the ``Replicate``
   dims; HSDP replicas each form their own group and compute the same
   thing), send their dense momentum (and NorMuon rows) to one owner
   (``assign_owners``); the owner assembles the matrix, runs Newton-Schulz
   and NorMuon on it, and sends each member its slice of the update and of
   the updated rows;
3. every rank applies decoupled weight decay and its slice of the update.

Messages are point-to-point (``isend``/``irecv``: gloo and NCCL both have
them) between the members of a group, one matrix at a time, so no process
group is created and a rank takes part only in its own matrices' messages
(pipeline stages hold disjoint matrices; a rank without GefenMuon
parameters exchanges nothing). In flight per rank: its momentum shards, and
on an owner one whole matrix at a time.

All members of a group must see the same gradient presence (FSDP2 and TP
give every shard a gradient or none); a matrix without a gradient is
skipped, as gefen-x skips it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim import Optimizer

from gefen_titan.distributed import local, rank_and_world
from gefen_titan.optim import gefen_state as gs

__all__ = ["MuonLayoutError", "Piece", "ShardedMuonStep", "assign_owners", "shard_groups", "shard_indices"]


class MuonLayoutError(RuntimeError):
    """A GefenMuon parameter whose placements the sharded step cannot assemble."""


# ------------------------------------------------------------------ layout
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
    for mesh_dim, pl in enumerate(placements):
        if pl.is_replicate():
            continue
        if type(pl) not in (Shard, _StridedShard):
            raise MuonLayoutError(f"placement {pl} (only Shard, _StridedShard and Replicate hold a parameter)")
        d = pl.dim % len(shape)
        one_d = _StridedShard(0, split_factor=pl.split_factor) if type(pl) is _StridedShard else Shard(0)
        # DTensor's own split (uneven and strided shards alike); tests compare it with real shards.
        pieces, _ = one_d._split_tensor(ix[d], mesh_shape[mesh_dim], with_padding=False)  # noqa: SLF001
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


def assign_owners(matrices: list[tuple[int, tuple[int, ...]]]) -> list[int]:
    """The owner rank of each (numel, shard group) matrix: deterministic, load-balanced.

    Per distinct group, the matrices that group holds are taken largest
    first (ties: earlier first) and each goes to the member with the least
    numel assigned so far (ties: the earlier member); an empty group (a
    matrix each rank holds whole) has no owner (-1). A pure function of the
    list, which every member of a group builds alike from the parameters it
    holds; groups are balanced on their own, so a rank never needs to know
    matrices it does not hold (another stage's, another TP column's).
    """
    owners = [-1] * len(matrices)
    by_group: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, (_, group) in enumerate(matrices):
        if group:
            by_group[group].append(i)
    for group, items in by_group.items():
        load = [0] * len(group)
        for i in sorted(items, key=lambda i: (-matrices[i][0], i)):
            pos = min(range(len(group)), key=lambda j: (load[j], j))
            load[pos] += matrices[i][0]
            owners[i] = group[pos]
    return owners


def _as_slice(idx: torch.Tensor) -> slice | torch.Tensor:
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


@dataclass
class _Matrix:
    fqn: str
    param: torch.Tensor
    optim: Optimizer
    group: dict
    pieces: list[Piece]  # this rank's shard group; empty: the whole matrix is here
    owner: int
    me: int  # index of this rank's piece (0 when whole)


def _matrices(optimizers: list[Optimizer]) -> list[_Matrix]:
    rank, _ = rank_and_world()
    found, sizes = [], []
    for optim in optimizers:
        for fqn, p, group in gs.named_params(optim):
            pieces: list[Piece] = []
            key: tuple[int, ...] = ()
            if isinstance(p, DTensor):
                mine = next((g for g in shard_groups(p) if any(r == rank for r, _ in g)), None)
                if mine is None:
                    raise MuonLayoutError(f"{fqn}: this rank holds a parameter of a mesh it is not in")
                if len(mine) > 1:
                    mesh_shape = tuple(p.device_mesh.shape)
                    for r, coord in mine:
                        rows, cols = shard_indices(tuple(p.shape), mesh_shape, p.placements, coord)
                        pieces.append(Piece(r, _as_slice(rows), _as_slice(cols), rows.numel(), cols.numel()))
                    key = tuple(r for r, _ in mine)
            found.append(_Matrix(fqn, p, optim, group, pieces, rank, 0))
            sizes.append((p.numel(), key))
    owners = assign_owners(sizes)
    for m, owner in zip(found, owners):
        if m.pieces:
            m.owner = owner
            m.me = next(i for i, pc in enumerate(m.pieces) if pc.rank == rank)
            mine = m.pieces[m.me]
            if (mine.nrows, mine.ncols) != tuple(local(m.param).shape):
                raise MuonLayoutError(f"{m.fqn}: the local shard is {tuple(local(m.param).shape)}, the placements "
                                      f"{tuple(m.param.placements)} say {(mine.nrows, mine.ncols)}")
    return found


# -------------------------------------------------------------------- step
class ShardedMuonStep:
    """One GefenMuon optimizer's step on this rank (see the module doc).

    The ranks that hold a stage's parameters hold the same GefenMuon
    optimizers and step them in the same order (torchtitan's container
    loop), so their messages match. The matrices' groups and owners are
    fixed on the first call.
    """

    def __init__(self, optim: Optimizer) -> None:
        self.optimizers = [optim]
        self._matrices: list[_Matrix] | None = None

    @torch.no_grad()
    def __call__(self) -> None:
        if self._matrices is None:
            self._matrices = _matrices(self.optimizers)
        for m in self._matrices:
            if m.param.grad is None:
                continue
            grad = local(m.param.grad)
            dense = gs.muon_momentum(m.optim, m.fqn, m.param, m.group, grad)
            update = self._whole(m, dense) if not m.pieces else self._exchange(m, dense)
            gs.muon_apply(m.optim, m.group, m.param, update)
        for optim in self.optimizers:
            gs.advance_global_step(optim)

    @staticmethod
    def _whole(m: _Matrix, dense: torch.Tensor) -> torch.Tensor:
        ortho = gs.muon_orthogonalize(m.group, dense)
        if m.group["normuon"]:
            rows, rows_step = gs.muon_rows(m.optim, m.param)
            ortho, rows, rows_step = gs.muon_normuon(m.optim, m.group, ortho, rows, rows_step)
            gs.muon_set_rows(m.optim, m.param, rows, rows_step)
        return ortho

    @staticmethod
    def _exchange(m: _Matrix, dense: torch.Tensor) -> torch.Tensor:
        """Gather the momentum to the owner, orthogonalize there, scatter the update back."""
        mine = m.pieces[m.me]
        normuon = bool(m.group["normuon"])
        rows, rows_step = gs.muon_rows(m.optim, m.param)
        has_rows = normuon and rows_step > 0  # the same on every member: a counter of the group's steps
        device = dense.device
        if m.owner != mine.rank:
            sends = []
            if mine.numel:
                sends.append(dist.isend(dense.contiguous(), m.owner))
            if has_rows and mine.nrows:
                sends.append(dist.isend(rows.contiguous(), m.owner))
            update = torch.empty((mine.nrows, mine.ncols), dtype=gs.MUON_UPDATE_DTYPE, device=device)
            new_rows = torch.empty((mine.nrows, 1), dtype=torch.float32, device=device)
            recvs = []
            if mine.numel:
                recvs.append(dist.irecv(update, m.owner))
            if normuon and mine.nrows:
                recvs.append(dist.irecv(new_rows, m.owner))
            for work in sends + recvs:
                work.wait()
            if normuon:
                gs.muon_set_rows(m.optim, m.param, new_rows, rows_step + 1)
            return update
        shape = tuple(m.param.shape)
        full = torch.empty(shape, dtype=dense.dtype, device=device)
        full_rows = torch.empty((shape[0], 1), dtype=torch.float32, device=device) if has_rows else None
        recvs = []
        for pc in m.pieces:
            if pc.rank == mine.rank:
                pc.put(full, dense)
                if full_rows is not None:
                    full_rows[pc.rows] = rows
                continue
            if pc.numel:
                buf = torch.empty((pc.nrows, pc.ncols), dtype=dense.dtype, device=device)
                recvs.append((pc, buf, False, dist.irecv(buf, pc.rank)))
            if full_rows is not None and pc.nrows:
                buf = torch.empty((pc.nrows, 1), dtype=torch.float32, device=device)
                recvs.append((pc, buf, True, dist.irecv(buf, pc.rank)))
        for pc, buf, is_rows, work in recvs:
            work.wait()
            if is_rows:
                full_rows[pc.rows] = buf
            else:
                pc.put(full, buf)
        ortho = gs.muon_orthogonalize(m.group, full).to(gs.MUON_UPDATE_DTYPE)
        if normuon:
            ortho, full_rows, rows_step = gs.muon_normuon(m.optim, m.group, ortho, full_rows, rows_step)
        sends = []
        for pc in m.pieces:
            if pc.rank == mine.rank:
                continue
            if pc.numel:
                sends.append(dist.isend(pc.take(ortho).contiguous(), pc.rank))
            if normuon and pc.nrows:
                sends.append(dist.isend(full_rows[pc.rows].contiguous(), pc.rank))
        update = mine.take(ortho).contiguous()
        if normuon:
            gs.muon_set_rows(m.optim, m.param, full_rows[mine.rows].clone(), rows_step)
        for work in sends:
            work.wait()
        return update
