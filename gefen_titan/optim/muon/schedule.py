"""Which rank orthogonalizes which GefenMuon matrix, and in which bucket: a pure plan.

Newton-Schulz needs the whole matrix, so each matrix a *shard group* holds
(the ranks that hold one copy of it, cut; see ``layout.shard_groups``) is
gathered to one member, its *owner*. The step runs in buckets: per bucket
one exchange brings every matrix's momentum to its owner, every owner
orthogonalizes its matrices of the bucket at the same time, and one reverse
exchange returns the updates. So the step costs, per bucket, the busiest
owner's Newton-Schulz, and what a rank holds in flight is bounded by its
share of one bucket (two, with the next bucket's exchange under way).

The plan is a pure function of the matrices' FQNs, shapes, Newton-Schulz
steps and shard groups (every member computes it alike, with no
communication) and never enters a checkpoint. It decides *where* and *when*
each matrix is orthogonalized, never *how*: every matrix still runs its own
Newton-Schulz, whole, so the result is bit-identical whatever the mesh, the
bucket size or the owner (batched Newton-Schulz would change the GEMMs'
reduction order with the batch's make-up, which here depends on the mesh).

* **Cost**: Newton-Schulz FLOPs, ``2 * ns_steps * s^2 * (2l + s)`` for an
  ``s x l`` matrix (s the smaller dim): per step two ``s^2 l`` GEMMs and one
  ``s^3``, two FLOPs a multiply-add. Balancing by numel would put a square
  matrix and a long thin one of equal size on a par; their costs differ by
  the ratio of their smaller dims squared.
* **Owners** (``lpt``): within a bucket, a matrix only one member holds
  (a whole expert under expert parallelism) is that member's; then the
  others by cost, largest first (ties: FQN), each to the member of its
  shard group with the least cost in this bucket (over every matrix, dense
  and expert, whatever its group), then the least carried over from earlier
  buckets, then the earlier member. Balancing the bucket first is what
  makes owners compute at once (the bucket's time is its busiest owner's);
  the carried loads spread the bucket-sized remainders over the whole step.
* **Buckets** (``build_schedule``): consecutive runs of the matrices in step
  order, as long as the bytes each rank holds for the bucket (``rank_bytes``:
  the dense fp32 momentum and NorMuon rows it sends, plus the whole
  matrices it owns or holds whole) stay
  within the limit: ``bucket_bytes``, raised to twice the largest matrix so
  that an owner can always take one whole matrix beside its shares (a
  smaller limit would put one matrix in a bucket and run the owners one
  after another again), and to one whole parameter's bytes. A bucket is the
  longest run that fits (found by bisection), at least one parameter, and it
  ends only between parameters: a grouped experts' weight (``param``: its
  matrices share it) gets its momentum computed once, for all its experts.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DEFAULT_BUCKET_MIB", "MOMENTUM_BYTES", "UPDATE_BYTES", "Bucket", "MatrixSpec", "Schedule",
           "build_schedule", "exchange_bytes", "lpt", "ns_flops", "owner_loads", "rank_bytes"]

# The dense momentum and the assembled matrix are fp32 (gefen-x dequantizes to
# fp32); the update Newton-Schulz returns is bf16.
MOMENTUM_BYTES = 4
UPDATE_BYTES = 2

# [optimizer.muon] bucket_mib's default: at 70B (the largest matrix 0.94 GB
# fp32) the limit is already twice the largest matrix, so the default only
# decides for models whose matrices are smaller than 256 MiB, where it keeps
# several buckets (the next one's exchange overlaps this one's compute).
DEFAULT_BUCKET_MIB = 512


def ns_flops(shape: Sequence[int], ns_steps: int) -> int:
    """Newton-Schulz FLOPs of one matrix (see the module doc)."""
    short, long = sorted(int(n) for n in shape)
    return 2 * int(ns_steps) * short * short * (2 * long + short)


@dataclass(frozen=True)
class MatrixSpec:
    """One GefenMuon matrix as the plan sees it."""

    fqn: str
    shape: tuple[int, int]
    ns_steps: int
    members: tuple[int, ...]  # global ranks of this rank's shard group; () when every rank holds it whole
    shard_numel: tuple[int, ...]  # the numel each member holds, aligned with members
    shard_rows: tuple[int, ...] = ()  # the rows each member holds (NorMuon's rows travel with the momentum)
    param: str = ""  # the parameter it is part of, where that is not the matrix itself (an expert's weight)

    @property
    def param_key(self) -> str:
        return self.param or self.fqn

    @property
    def cost(self) -> int:
        return ns_flops(self.shape, self.ns_steps)

    @property
    def nbytes(self) -> int:
        """The whole matrix's dense momentum and NorMuon rows."""
        return self.shape[0] * (self.shape[1] + 1) * MOMENTUM_BYTES

    def shard_bytes(self, j: int) -> int:
        rows = self.shard_rows[j] if self.shard_rows else 0
        return (self.shard_numel[j] + rows) * MOMENTUM_BYTES


@dataclass(frozen=True)
class Bucket:
    """Indices into the matrix list (step order) and each one's owner rank (-1: held whole, no owner)."""

    matrices: tuple[int, ...]
    owners: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    buckets: tuple[Bucket, ...]
    limit_bytes: int  # the per-rank bound each bucket keeps (rank_bytes)

    def owner_of(self) -> dict[int, int]:
        return {i: o for b in self.buckets for i, o in zip(b.matrices, b.owners)}


def lpt(specs: Sequence[MatrixSpec], items: Sequence[int], carried: dict[tuple[int, ...], list[int]]
        ) -> tuple[dict[int, int], dict[tuple[int, ...], list[int]]]:
    """Owners of ``items`` (one bucket) and the carried loads after it (see the module doc).

    ``carried`` maps a shard group to its members' costs so far (aligned
    with the group); it is not changed. Items held whole get owner -1.
    """
    owners: dict[int, int] = {}
    after = {g: list(v) for g, v in carried.items()}
    load: dict[int, int] = {}  # this bucket's cost per rank, over every group
    shared = []
    for i in items:
        members = specs[i].members
        if not members:
            owners[i] = -1
        elif len(members) == 1:  # only one member holds it: no choice, but its cost counts
            owners[i] = members[0]
            load[members[0]] = load.get(members[0], 0) + specs[i].cost
            after.setdefault(members, [0])[0] += specs[i].cost
        else:
            shared.append(i)
    heaps: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
    for i in sorted(shared, key=lambda i: (-specs[i].cost, specs[i].fqn)):
        group = specs[i].members
        cum = after.setdefault(group, [0] * len(group))
        heap = heaps.get(group)
        if heap is None:
            heap = heaps[group] = [(load.get(r, 0), cum[j], j) for j, r in enumerate(group)]
            heapq.heapify(heap)
        while True:  # loads only grow: an entry another group's choice made stale is pushed again, updated
            key = heapq.heappop(heap)
            j = key[2]
            now = (load.get(group[j], 0), cum[j], j)
            if key == now:
                break
            heapq.heappush(heap, now)
        owners[i] = group[j]
        cum[j] += specs[i].cost
        load[group[j]] = load.get(group[j], 0) + specs[i].cost
        heapq.heappush(heap, (load[group[j]], cum[j], j))
    return owners, after


def rank_bytes(specs: Sequence[MatrixSpec], owners: dict[int, int]) -> dict[int, int]:
    """Per rank, the dense bytes one bucket puts in flight there: the momentum
    it sends to other owners, plus each whole matrix it owns or holds whole."""
    out: dict[int, int] = {}
    for i, owner in owners.items():
        m = specs[i]
        if owner < 0:
            out[-1] = out.get(-1, 0) + m.nbytes  # every rank: its own whole copy
            continue
        for j, r in enumerate(m.members):
            out[r] = out.get(r, 0) + (m.nbytes if r == owner else m.shard_bytes(j))
    whole = out.pop(-1, 0)
    return {r: b + whole for r, b in out.items()} if out else ({-1: whole} if whole else {})


class _RangeBytes:
    """``max(rank_bytes(specs, owners).values())`` for a run ``[a, b)`` of the matrices, from prefix
    sums per shard group: O(members of the groups in the run + the run's length) where ``rank_bytes``
    walks every member of every matrix. ``build_schedule`` asks it for many runs (its search), and at
    1,024 ranks (DeepSeek-V3 671B: ~45,000 expert matrices and ~500 dense ones, each of the latter
    with 1,024 members) the walks took about a minute on every rank."""

    def __init__(self, specs: Sequence[MatrixSpec]) -> None:
        self.specs = specs
        by_group: dict[tuple[int, ...], list[int]] = {}
        for i, m in enumerate(specs):
            if m.members:
                by_group.setdefault(m.members, []).append(i)
        self.groups = []
        self.position = {group: {r: j for j, r in enumerate(group)} for group in by_group}
        for group, idx in by_group.items():
            sent = np.array([[specs[i].shard_bytes(j) for j in range(len(group))] for i in idx], dtype=np.int64)
            prefix = np.zeros((len(idx) + 1, len(group)), dtype=np.int64)
            np.cumsum(sent, axis=0, out=prefix[1:])
            self.groups.append((np.array(idx), np.array(group), prefix))
        whole = np.array([0 if m.members else m.nbytes for m in specs], dtype=np.int64)
        self.whole = np.concatenate([[0], np.cumsum(whole)])
        self.size = 1 + max((r for m in specs for r in m.members), default=0)

    def __call__(self, a: int, b: int, owners: dict[int, int]) -> int:
        held = np.zeros(self.size, dtype=np.int64)
        present = False
        for idx, group, prefix in self.groups:
            lo, hi = np.searchsorted(idx, a), np.searchsorted(idx, b)
            if lo < hi:
                held[group] += prefix[hi] - prefix[lo]  # every member sends its shard...
                present = True
        for i in range(a, b):
            owner, m = owners[i], self.specs[i]
            if owner >= 0:  # ...but the owner holds the whole matrix instead
                held[owner] += m.nbytes - m.shard_bytes(self.position[m.members][owner])
        whole = int(self.whole[b] - self.whole[a])
        return (int(held.max()) if present else 0) + whole


def build_schedule(specs: Sequence[MatrixSpec], bucket_bytes: int) -> Schedule:
    """The buckets and owners of ``specs`` (in step order) under ``bucket_bytes`` (see the module doc)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    n = len(specs)
    # A bucket may end only where a parameter ends (ends[k]: the end after the k-th parameter).
    ends = [i + 1 for i in range(n) if i + 1 == n or specs[i].param_key != specs[i + 1].param_key]
    starts = [0] + ends[:-1]
    held = _RangeBytes(specs)
    whole_param = [held(a, b, lpt(specs, range(a, b), {})[0]) for a, b in zip(starts, ends)]
    limit = max([int(bucket_bytes)] + [2 * m.nbytes for m in specs] + whole_param)
    carried: dict[tuple[int, ...], list[int]] = {}
    buckets = []
    k = 0  # the first parameter of the next bucket

    def fits(last: int):
        owners, after = lpt(specs, range(starts[k], ends[last]), carried)
        return held(starts[k], ends[last], owners) <= limit, owners, after

    while k < len(ends):
        ok, owners, after = fits(k)  # one parameter always makes a bucket
        lo, hi = k, len(ends) - 1
        best = (owners, after)
        step = 1
        while lo < hi:  # exponential search for an end that does not fit, then bisection
            probe = min(hi, lo + step)
            ok, owners, after = fits(probe)
            if ok:
                lo, best = probe, (owners, after)
                step *= 2
            else:
                hi = probe - 1
                step = 1
        owners, carried = best
        first, end = starts[k], ends[lo]
        buckets.append(Bucket(tuple(range(first, end)), tuple(owners[i] for i in range(first, end))))
        k = lo + 1
    return Schedule(tuple(buckets), limit)


def owner_loads(specs: Sequence[MatrixSpec], schedule: Schedule) -> dict[int, int]:
    """Per rank, the Newton-Schulz FLOPs it runs in a step (whole matrices count on every rank)."""
    loads: dict[int, int] = {}
    whole = 0
    for i, owner in schedule.owner_of().items():
        if owner < 0:
            whole += specs[i].cost
        else:
            loads[owner] = loads.get(owner, 0) + specs[i].cost
    ranks = {r for m in specs for r in m.members}
    return {r: loads.get(r, 0) + whole for r in ranks} if ranks else {-1: whole}


def exchange_bytes(specs: Sequence[MatrixSpec], schedule: Schedule) -> dict[int, int]:
    """Per rank, the bytes it sends plus receives in one step: each member's
    fp32 momentum and rows to the owner, and the owner's bf16 update slices
    and fp32 rows back (what ``step`` moves, before the packing's padding)."""
    out: dict[int, int] = {}
    for i, owner in schedule.owner_of().items():
        m = specs[i]
        if owner < 0:
            continue
        for j, r in enumerate(m.members):
            if r == owner:
                continue
            rows = m.shard_rows[j] if m.shard_rows else 0
            moved = m.shard_numel[j] * (MOMENTUM_BYTES + UPDATE_BYTES) + 2 * rows * MOMENTUM_BYTES
            out[r] = out.get(r, 0) + moved
            out[owner] = out.get(owner, 0) + moved
    return out
