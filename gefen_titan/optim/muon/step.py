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
from gefen_titan.distributed.layout import LayoutError, local_box
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.muon.exchange import Exchange
from gefen_titan.optim.muon.matrices import MuonLayoutError, Piece, is_grouped, matrix_cuts, shard_groups
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


def _matrices(optimizers: list[Optimizer]) -> list[_Matrix]:
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
                found.append(_Matrix(c.fqn, fqn, p, optim, group, c.shape, c.pieces, me, local_expert))
    return found


def matrix_spec(m: _Matrix) -> MatrixSpec:
    return MatrixSpec(m.fqn, m.shape, int(m.group["ns_steps"]),
                      tuple(pc.rank for pc in m.pieces), tuple(pc.numel for pc in m.pieces),
                      tuple(pc.nrows for pc in m.pieces), m.param_fqn if m.param_fqn != m.fqn else "")


@dataclass
class _Param:
    """One parameter of a bucket on this rank: its dense momentum (the whole local shard: every
    local expert's at once), its NorMuon rows and counter, and its matrices in the bucket."""

    fqn: str
    param: torch.Tensor
    optim: Optimizer
    group: dict
    matrices: list[int]  # bucket indices of its matrices this rank holds
    dense: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    rows_step: int = 0

    @property
    def grouped(self) -> bool:
        return is_grouped(tuple(self.param.shape))

    def of(self, t: torch.Tensor | None, m: _Matrix) -> torch.Tensor | None:
        """One matrix's part of ``t`` (the shard's momentum, or its NorMuon rows [rows, 1])."""
        if t is None or not self.grouped:
            return t
        return t.view(local(self.param).shape[0], -1, t.shape[-1])[m.local_expert]


class _Bucket:
    """One bucket's step on this rank: ``prepare`` (momentum, post the inputs), ``compute``
    (Newton-Schulz on the owned and whole matrices, post the returns), ``finish`` (apply)."""

    def __init__(self, matrices: list[_Matrix], inflight: _InFlight, stats: MuonStepStats) -> None:
        self.matrices, self.inflight, self.stats = matrices, inflight, stats
        self.rank = rank_and_world()[0]
        self.device = local(matrices[0].param).device
        self.params: dict[int, _Param] = {}  # id(param) -> its momentum and rows, in step order
        for i, m in enumerate(matrices):
            run = self.params.setdefault(id(m.param), _Param(m.param_fqn, m.param, m.optim, m.group, []))
            if m.me >= 0:
                run.matrices.append(i)
        self.updates: dict[int, torch.Tensor] = {}  # matrix index -> this rank's slice of the update
        self.rows: dict[int, tuple[torch.Tensor, int]] = {}  # matrix index -> (new rows, rows_step)

    def _hold(self, t: torch.Tensor) -> torch.Tensor:
        self.inflight.add(t.nbytes)
        return t

    def prepare(self) -> None:
        self.full: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
        self.inputs = Exchange(self.device)
        self.asked: dict[int, list[tuple[Piece, int, int]]] = {}  # owned matrix -> (piece, dense idx, rows idx)
        for run in self.params.values():
            run.dense = self._hold(gx.muon_momentum(run.optim, run.fqn, run.param, run.group,
                                                    local(run.param.grad)))
            run.rows, run.rows_step = gx.muon_rows(run.optim, run.param)
            # alike on every member: a count of the group's steps
            has_rows = bool(run.group["normuon"]) and run.rows_step > 0
            for i in run.matrices:
                m = self.matrices[i]
                if not m.pieces:
                    continue
                dense, rows = run.of(run.dense, m), run.of(run.rows, m)
                mine = m.pieces[m.me]
                if m.owner != self.rank:
                    self.inputs.send(m.owner, dense)
                    if has_rows:
                        self.inputs.send(m.owner, rows)
                    continue
                if len(m.pieces) == 1:  # held by this rank alone (a whole expert): orthogonalized in place
                    continue
                full = self._hold(torch.empty(m.shape, dtype=dense.dtype, device=self.device))
                full_rows = torch.empty((m.shape[0], 1), dtype=torch.float32, device=self.device) \
                    if has_rows else None
                mine.put(full, dense)
                if full_rows is not None:
                    full_rows[mine.rows] = rows
                self.full[i] = (full, full_rows, run.rows_step)
                self.asked[i] = [(pc, self.inputs.recv(pc.rank, (pc.nrows, pc.ncols), dense.dtype),
                                  self.inputs.recv(pc.rank, (pc.nrows, 1), torch.float32) if has_rows else -1)
                                 for pc in m.pieces if pc.rank != self.rank]
            if run.matrices and all(self.matrices[i].owner == self.rank and not self._computes_here(i)
                                    for i in run.matrices):
                self.inflight.sub(run.dense.nbytes)  # copied into the matrices it assembles
                run.dense = None
        self.inputs.start()
        self.inflight.add(self.inputs.nbytes_sent + self.inputs.nbytes_received)
        for run in self.params.values():  # the packed copies travel; a shard sent whole goes
            if run.dense is not None and not any(self._computes_here(i) for i in run.matrices):
                self.inflight.sub(run.dense.nbytes)
                run.dense = None
        self._count(self.inputs)

    def _computes_here(self, i: int) -> bool:
        """Whether this rank orthogonalizes matrix ``i`` from its own dense momentum."""
        m = self.matrices[i]
        return not m.pieces or (m.owner == self.rank and len(m.pieces) == 1)

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
        for run in self.params.values():
            for i in run.matrices:
                m = self.matrices[i]
                if self._computes_here(i):
                    rows = run.of(run.rows, m)
                    if rows is not None:
                        rows = rows.clone()  # NorMuon updates it in place; the param's rows are set at the end
                    ortho, rows, rows_step = self._orthogonalize(m, run.of(run.dense, m), rows, run.rows_step)
                    if m.group["normuon"]:
                        self.rows[i] = (rows, rows_step)
                    self.updates[i] = self._hold(ortho)
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
            if run.dense is not None:
                self.inflight.sub(run.dense.nbytes)
                run.dense = None
        self.inflight.sub(self.inputs.nbytes_received)
        del received
        self.returns.start()
        self.inflight.add(self.returns.nbytes_sent + self.returns.nbytes_received)
        self.inflight.sub(orthos)
        self._count(self.returns)

    def finish(self) -> None:
        received = self.returns.wait()
        self.inflight.sub(self.returns.nbytes_sent)
        for run in self.params.values():
            for i in run.matrices:
                m = self.matrices[i]
                if i in self.expect:
                    ui, ri = self.expect.pop(i)
                    mine = m.pieces[m.me]
                    self.updates[i] = (received[m.owner][ui] if ui >= 0 else
                                       torch.empty((mine.nrows, mine.ncols), dtype=gx.MUON_UPDATE_DTYPE,
                                                   device=self.device))
                    if ri >= 0:
                        self.rows[i] = (received[m.owner][ri].clone(), run.rows_step + 1)
                else:
                    self.inflight.sub(self.updates[i].nbytes)
            self._apply(run)
        self.inflight.sub(self.returns.nbytes_received)

    def _apply(self, run: _Param) -> None:
        """Set the parameter's NorMuon rows and apply its update (every local expert's at once)."""
        shard = local(run.param)
        if not run.grouped:
            (i,) = run.matrices or (None,)
            update = self.updates.pop(i) if i is not None else \
                torch.empty(tuple(shard.shape), dtype=gx.MUON_UPDATE_DTYPE, device=self.device)
            if i is not None and i in self.rows:
                gx.muon_set_rows(run.optim, run.param, *self.rows.pop(i))
            elif run.group["normuon"]:  # an empty shard: no rows travel, the counter still moves
                gx.muon_set_rows(run.optim, run.param, torch.empty((0, 1), dtype=torch.float32, device=self.device),
                                 run.rows_step + 1)
            gx.muon_apply(run.optim, run.group, run.param, update)
            return
        update = torch.empty(tuple(shard.shape), dtype=gx.MUON_UPDATE_DTYPE, device=self.device)
        rows = torch.empty((shard.shape[0], shard.shape[1], 1), dtype=torch.float32, device=self.device) \
            if run.group["normuon"] else None
        for i in run.matrices:
            m = self.matrices[i]
            update[m.local_expert] = self.updates.pop(i)
            if rows is not None:
                rows[m.local_expert] = self.rows.pop(i)[0]
        if rows is not None:
            gx.muon_set_rows(run.optim, run.param, rows.view(-1, 1), run.rows_step + 1)
        gx.muon_apply(run.optim, run.group, run.param, update)


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
        return [matrix_spec(m) for m in self._matrices], self.schedule

    def _plan(self) -> None:
        self._matrices = _matrices(self.optimizers)
        self.schedule = build_schedule([matrix_spec(m) for m in self._matrices], self.bucket_bytes)
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
