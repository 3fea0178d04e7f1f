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

import torch
from torch.optim import Optimizer

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.muon.bucket import BucketStep
from gefen_titan.optim.muon.schedule import MatrixSpec, Schedule, build_schedule
from gefen_titan.optim.muon.stats import COPIES, SLOTS, InFlight, MuonStepStats
from gefen_titan.optim.muon.step_matrices import StepMatrix, matrix_spec, step_matrices

__all__ = ["ShardedMuonStep"]


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
        self._matrices: list[StepMatrix] | None = None
        self.schedule: Schedule | None = None
        self._buckets: list[list[StepMatrix]] = []

    def plan(self) -> tuple[list[MatrixSpec], Schedule]:
        """The matrices as the schedule sees them and the schedule (made on the first call or step)."""
        if self._matrices is None:
            self._plan()
        return [matrix_spec(m) for m in self._matrices], self.schedule

    def _plan(self) -> None:
        self._matrices = step_matrices(self.optimizers)
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
        inflight = InFlight(self.stats)
        runs = [BucketStep(ms, inflight, self.stats) for b in self._buckets
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
