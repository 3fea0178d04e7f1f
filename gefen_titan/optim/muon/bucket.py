"""One bucket of GefenMuon's sharded step on one rank: momentum, exchange, Newton-Schulz, apply.

``step.ShardedMuonStep`` runs the buckets two at a time (the module doc of
``step`` gives the protocol and why it is exact at every layout); this is
one bucket's part, in three calls so that the next bucket's exchange can
travel while this one computes: ``prepare`` (momentum on the local shard,
post the inputs to the owners), ``compute`` (Newton-Schulz and NorMuon on
the matrices this rank owns or holds whole, post each member its slice),
``finish`` (decoupled weight decay and the update, NorMuon rows set). Every
buffer it holds is counted in ``InFlight``, against the bound
``stats.MuonStepStats`` reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from gefen_titan.distributed import local, rank_and_world
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.muon.exchange import Exchange
from gefen_titan.optim.muon.matrices import Piece, is_grouped
from gefen_titan.optim.muon.stats import InFlight, MuonStepStats
from gefen_titan.optim.muon.step_matrices import StepMatrix

__all__ = ["BucketStep"]


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

    def of(self, t: torch.Tensor | None, m: StepMatrix) -> torch.Tensor | None:
        """One matrix's part of ``t`` (the shard's momentum, or its NorMuon rows [rows, 1])."""
        if t is None or not self.grouped:
            return t
        return t.view(local(self.param).shape[0], -1, t.shape[-1])[m.local_expert]


class BucketStep:
    """One bucket's step on this rank: ``prepare`` (momentum, post the inputs), ``compute``
    (Newton-Schulz on the owned and whole matrices, post the returns), ``finish`` (apply)."""

    def __init__(self, matrices: list[StepMatrix], inflight: InFlight, stats: MuonStepStats) -> None:
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

    def _orthogonalize(self, m: StepMatrix, full: torch.Tensor, rows: torch.Tensor | None, rows_step: int
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
