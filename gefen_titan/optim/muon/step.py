"""GefenMuon's sharded step: momentum on the parameter's shards, Newton-Schulz on every owner at once.

gefen-x's GefenMuon gathers every full gradient on every rank and keeps the
full-matrix quantized momentum everywhere (``sharded_mode="exact"``), or on
an owner chosen by ``index % world`` on 1-D meshes only. gefen-titan never
runs its ``step()``: ``ShardedMuonStep`` (the ``step()`` of the GefenMuon
the registry builds, ``gefenx.ShardedGefenMuon``) drives gefen-x's own
pieces (``gefenx.muon_*``) so that each rank keeps only its share of
the state and the arithmetic is gefen-x's, bit for bit, at every layout.

The matrices go in buckets (``schedule.build_schedule``: bounded bytes per
rank, owners balanced by Newton-Schulz cost). Per bucket, in the same order
on every rank:

1. **momentum on the local shard**: the quantized codes, block magnitudes
   and (with NorMuon) the rows of the shard live where the parameter's
   shard lives. Agreed blocking's periods divide the row length and every
   allowed column cut, so every block lies inside one shard and the
   shard's momentum equals the full matrix's on those elements;
2. **one exchange** (``exchange.Exchange``): every member of a matrix's
   shard group (the ranks holding one copy of it; HSDP replicas each form
   their own group and compute the same thing) sends its dense momentum
   (and NorMuon rows) to the matrix's owner, packed per peer;
3. **every owner at once** assembles its matrices of the bucket and runs
   Newton-Schulz and NorMuon on each, whole and one by one (never batched:
   a batch's GEMMs change the reduction order, and here its make-up would
   depend on the mesh), then one reverse exchange sends each member its
   slice of the update and of the updated rows;
4. every rank applies decoupled weight decay and its slice of the update.

Two buckets are live at a time: the next bucket's momentum is computed and
its exchange posted before this bucket's Newton-Schulz runs, so the
transfer overlaps the compute (gloo progresses it on its own thread; NCCL
on its stream). The exchanges' posting order (inputs 0, inputs 1, returns
0, inputs 2, returns 1, ...) is the same on every rank, which is what
pairs the messages (``exchange``'s doc).

A matrix held whole (one rank, or replicated) is orthogonalized where it is,
by every rank that holds it. A rank takes part only in its own matrices'
exchanges (pipeline stages hold disjoint matrices; a rank without GefenMuon
parameters exchanges nothing). All members of a group must see the same
gradient presence (FSDP2 and TP give every shard a gradient or none); a
matrix without a gradient is skipped, as gefen-x skips it.

``stats`` (``MuonStepStats``) counts what benchmarks print: the step's and
Newton-Schulz's seconds, the bytes exchanged, and the peak bytes the step
holds in flight against the bound ``2 slots x 2 x schedule.limit_bytes``
(per bucket a rank holds at most the schedule's ``rank_bytes`` plus one
copy of them: a packed buffer, or the received pieces of a matrix being
assembled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from gefen_titan.distributed import local, rank_and_world
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.muon.exchange import Exchange
from gefen_titan.optim.muon.layout import MuonLayoutError, Piece, as_slice, shard_groups, shard_indices
from gefen_titan.optim.muon.schedule import MatrixSpec, Schedule, build_schedule

__all__ = ["COPIES", "SLOTS", "MuonStepStats", "ShardedMuonStep"]

# Per bucket, a rank holds at most rank_bytes plus one copy of them; two buckets are live.
SLOTS, COPIES = 2, 2


@dataclass
class MuonStepStats:
    """What the steps since the last ``reset`` did on this rank (benchmarks read it)."""

    steps: int = 0
    seconds: float = 0.0
    ns_seconds: float = 0.0  # Newton-Schulz and NorMuon on the matrices this rank orthogonalizes
    ns_matrices: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_inflight_bytes: int = 0
    bound_bytes: int = 0  # SLOTS * COPIES * the schedule's limit
    buckets: int = 0
    sync_cuda: bool = False  # time the device work too (benchmarks; costs a sync per matrix)

    def reset(self) -> None:
        keep = (self.bound_bytes, self.buckets, self.sync_cuda)
        self.__init__()
        self.bound_bytes, self.buckets, self.sync_cuda = keep


class _InFlight:
    def __init__(self, stats: MuonStepStats) -> None:
        self.live, self.stats = 0, stats

    def add(self, n: int) -> None:
        self.live += n
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.live)

    def sub(self, n: int) -> None:
        self.live -= n


@dataclass
class _Matrix:
    fqn: str
    param: torch.Tensor
    optim: Optimizer
    group: dict
    pieces: list[Piece]  # this rank's shard group; empty: the whole matrix is here
    me: int  # index of this rank's piece (0 when whole)
    owner: int = -1


def _matrices(optimizers: list[Optimizer]) -> list[_Matrix]:
    rank, _ = rank_and_world()
    found = []
    for optim in optimizers:
        for fqn, p, group in gx.named_params(optim):
            m = _Matrix(fqn, p, optim, group, [], 0)
            if isinstance(p, DTensor):
                mine = next((g for g in shard_groups(p) if any(r == rank for r, _ in g)), None)
                if mine is None:
                    raise MuonLayoutError(f"{fqn}: this rank holds a parameter of a mesh it is not in")
                if len(mine) > 1:
                    mesh_shape = tuple(p.device_mesh.shape)
                    for r, coord in mine:
                        rows, cols = shard_indices(tuple(p.shape), mesh_shape, p.placements, coord)
                        m.pieces.append(Piece(r, as_slice(rows), as_slice(cols), rows.numel(), cols.numel()))
                    m.me = next(i for i, pc in enumerate(m.pieces) if pc.rank == rank)
                    piece = m.pieces[m.me]
                    if (piece.nrows, piece.ncols) != tuple(local(p).shape):
                        raise MuonLayoutError(f"{fqn}: the local shard is {tuple(local(p).shape)}, the placements "
                                              f"{tuple(p.placements)} say {(piece.nrows, piece.ncols)}")
            found.append(m)
    return found


def spec_of(m: _Matrix) -> MatrixSpec:
    return MatrixSpec(m.fqn, tuple(m.param.shape), int(m.group["ns_steps"]),
                      tuple(pc.rank for pc in m.pieces), tuple(pc.numel for pc in m.pieces),
                      tuple(pc.nrows for pc in m.pieces))


class _Bucket:
    """One bucket's step on this rank: ``prepare`` (momentum, post the inputs), ``compute``
    (Newton-Schulz on the owned and whole matrices, post the returns), ``finish`` (apply)."""

    def __init__(self, matrices: list[_Matrix], inflight: _InFlight, stats: MuonStepStats) -> None:
        self.matrices, self.inflight, self.stats = matrices, inflight, stats
        self.rank = rank_and_world()[0]
        self.device = local(matrices[0].param).device
        self.updates: dict[int, torch.Tensor] = {}  # matrix index -> this rank's slice of the update
        self.rows: dict[int, tuple[torch.Tensor, int]] = {}  # matrix index -> (new rows, rows_step)

    def _hold(self, t: torch.Tensor) -> torch.Tensor:
        self.inflight.add(t.nbytes)
        return t

    def prepare(self) -> None:
        self.dense: dict[int, torch.Tensor] = {}
        self.full: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
        self.inputs = Exchange(self.device)
        self.asked: dict[int, list[tuple[Piece, int, int]]] = {}  # owned matrix -> (piece, dense idx, rows idx)
        for i, m in enumerate(self.matrices):
            dense = self._hold(gx.muon_momentum(m.optim, m.fqn, m.param, m.group, local(m.param.grad)))
            if not m.pieces:
                self.dense[i] = dense
                continue
            mine = m.pieces[m.me]
            rows, rows_step = gx.muon_rows(m.optim, m.param)
            has_rows = bool(m.group["normuon"]) and rows_step > 0  # alike on every member: a count of the group's steps
            if m.owner != self.rank:
                self.inputs.send(m.owner, dense)
                if has_rows:
                    self.inputs.send(m.owner, rows)
                self.dense[i] = dense  # released once packed
                continue
            shape = tuple(m.param.shape)
            full = self._hold(torch.empty(shape, dtype=dense.dtype, device=self.device))
            full_rows = torch.empty((shape[0], 1), dtype=torch.float32, device=self.device) if has_rows else None
            mine.put(full, dense)
            if full_rows is not None:
                full_rows[mine.rows] = rows
            self.inflight.sub(dense.nbytes)
            self.full[i] = (full, full_rows, rows_step)
            self.asked[i] = [(pc, self.inputs.recv(pc.rank, (pc.nrows, pc.ncols), dense.dtype),
                              self.inputs.recv(pc.rank, (pc.nrows, 1), torch.float32) if has_rows else -1)
                             for pc in m.pieces if pc.rank != self.rank]
        self.inputs.start()
        self.inflight.add(self.inputs.nbytes_sent + self.inputs.nbytes_received)
        for i, m in enumerate(self.matrices):  # the packed copies travel; the shards' dense momentum goes
            if m.pieces and m.owner != self.rank:
                self.inflight.sub(self.dense.pop(i).nbytes)
        self._count(self.inputs)

    def _count(self, ex: Exchange) -> None:
        self.stats.bytes_sent += ex.nbytes_sent
        self.stats.bytes_received += ex.nbytes_received

    def _orthogonalize(self, m: _Matrix, full: torch.Tensor, rows: torch.Tensor | None, rows_step: int
                       ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        sync = self.stats.sync_cuda and full.is_cuda
        if sync:
            torch.cuda.synchronize(full.device)
        t0 = time.perf_counter()
        ortho = gx.muon_orthogonalize(m.group, full).to(gx.MUON_UPDATE_DTYPE)
        if m.group["normuon"]:
            ortho, rows, rows_step = gx.muon_normuon(m.optim, m.group, ortho, rows, rows_step)
        if sync:
            torch.cuda.synchronize(full.device)
        self.stats.ns_seconds += time.perf_counter() - t0
        self.stats.ns_matrices += 1
        return ortho, rows, rows_step

    def compute(self) -> None:
        received = self.inputs.wait()
        self.inflight.sub(self.inputs.nbytes_sent)
        self.returns = Exchange(self.device)
        self.expect: dict[int, tuple[int, int]] = {}  # non-owned matrix -> (update idx, rows idx)
        orthos = 0
        for i, m in enumerate(self.matrices):
            if not m.pieces:
                dense = self.dense.pop(i)
                rows, rows_step = gx.muon_rows(m.optim, m.param)
                ortho, rows, rows_step = self._orthogonalize(m, dense, rows, rows_step)
                if m.group["normuon"]:
                    self.rows[i] = (rows, rows_step)
                self.updates[i] = self._hold(ortho)
                self.inflight.sub(dense.nbytes)
                continue
            mine = m.pieces[m.me]
            if m.owner != self.rank:
                normuon = bool(m.group["normuon"])
                self.expect[i] = (self.returns.recv(m.owner, (mine.nrows, mine.ncols), gx.MUON_UPDATE_DTYPE),
                                  self.returns.recv(m.owner, (mine.nrows, 1), torch.float32) if normuon else -1)
                continue
            full, full_rows, rows_step = self.full.pop(i)
            for pc, di, ri in self.asked.pop(i):
                if di >= 0:
                    pc.put(full, received[pc.rank][di])
                if ri >= 0:
                    full_rows[pc.rows] = received[pc.rank][ri]
            ortho, full_rows, rows_step = self._orthogonalize(m, full, full_rows, rows_step)
            self.inflight.sub(full.nbytes)
            del full
            orthos += self._hold(ortho).nbytes  # until its slices are packed
            for pc in m.pieces:
                if pc.rank != self.rank:
                    self.returns.send(pc.rank, pc.take(ortho))
                    if full_rows is not None:
                        self.returns.send(pc.rank, full_rows[pc.rows])
            self.updates[i] = self._hold(mine.take(ortho).contiguous())
            if full_rows is not None:
                self.rows[i] = (full_rows[mine.rows].clone(), rows_step)
        self.inflight.sub(self.inputs.nbytes_received)
        del received
        self.returns.start()
        self.inflight.add(self.returns.nbytes_sent + self.returns.nbytes_received)
        self.inflight.sub(orthos)
        self._count(self.returns)

    def finish(self) -> None:
        received = self.returns.wait()
        self.inflight.sub(self.returns.nbytes_sent)
        for i, m in enumerate(self.matrices):
            if i in self.expect:
                ui, ri = self.expect[i]
                mine = m.pieces[m.me]
                update = (received[m.owner][ui] if ui >= 0 else
                          torch.empty((mine.nrows, mine.ncols), dtype=gx.MUON_UPDATE_DTYPE, device=self.device))
                if ri >= 0:
                    self.rows[i] = (received[m.owner][ri].clone(), gx.muon_rows(m.optim, m.param)[1] + 1)
                elif m.group["normuon"]:  # an empty shard: no rows travel, the counter still moves
                    self.rows[i] = (torch.empty((0, 1), dtype=torch.float32, device=self.device),
                                    gx.muon_rows(m.optim, m.param)[1] + 1)
            else:
                update = self.updates.pop(i)
                self.inflight.sub(update.nbytes)
            if i in self.rows:
                gx.muon_set_rows(m.optim, m.param, *self.rows.pop(i))
            gx.muon_apply(m.optim, m.group, m.param, update)
        self.inflight.sub(self.returns.nbytes_received)


class ShardedMuonStep:
    """One GefenMuon optimizer's step on this rank (see the module doc).

    The ranks that hold a stage's parameters hold the same GefenMuon
    optimizers and step them in the same order (torchtitan's container
    loop), so their exchanges match. The matrices' groups, buckets and
    owners are fixed on the first call (``schedule``); none of it is
    checkpointed.
    """

    def __init__(self, optim: Optimizer, bucket_bytes: int) -> None:
        self.optimizers = [optim]
        self.bucket_bytes = int(bucket_bytes)
        self.stats = MuonStepStats()
        self._matrices: list[_Matrix] | None = None
        self.schedule: Schedule | None = None
        self._buckets: list[list[_Matrix]] = []

    def plan(self) -> tuple[list[MatrixSpec], Schedule]:
        """The matrices as the schedule sees them and the schedule (made on the first call or step)."""
        if self._matrices is None:
            self._plan()
        return [spec_of(m) for m in self._matrices], self.schedule

    def _plan(self) -> None:
        self._matrices = _matrices(self.optimizers)
        self.schedule = build_schedule([spec_of(m) for m in self._matrices], self.bucket_bytes)
        self._buckets = []
        for b in self.schedule.buckets:
            for i, owner in zip(b.matrices, b.owners):
                self._matrices[i].owner = owner
            self._buckets.append([self._matrices[i] for i in b.matrices])
        self.stats.bound_bytes = SLOTS * COPIES * self.schedule.limit_bytes
        self.stats.buckets = len(self._buckets)

    @torch.no_grad()
    def __call__(self) -> None:
        t0 = time.perf_counter()
        if self._matrices is None:
            self._plan()
        inflight = _InFlight(self.stats)
        runs = [_Bucket(ms, inflight, self.stats) for b in self._buckets
                if (ms := [m for m in b if m.param.grad is not None])]
        if runs:
            runs[0].prepare()
        for i, run in enumerate(runs):
            if i + 1 < len(runs):
                runs[i + 1].prepare()  # its exchange travels while this bucket computes
            run.compute()
            run.finish()
        for optim in self.optimizers:
            gx.advance_global_step(optim)
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - t0
