"""Agreed blocking: one codebook and the same block periods on every rank.

gefen-x learns, on its first step, a block period per parameter and one
256-entry codebook per optimizer, each from the *local* gradient shard. Under
FSDP2/TP every rank then holds a different optimizer, and the state is a
function of the mesh. ``AgreedBlocking`` runs before Gefen's first step (a
step pre-hook on the optimizer container) and pre-sets both from global
statistics, so Gefen skips its own period search and codebook learning (as it
does on a resume) and the state is a function of the model alone:

* **Periods.** A block must never cross a shard cut at any layout the run may
  resume at. Candidates for a parameter with ``ndim >= 2`` are the divisors of
  its *row unit*: the gcd of the last dimension, of every last-dim cut of its
  live placements, and of the cuts that a tensor-parallel degree dividing
  ``max_tensor_parallel_degree`` would make. FSDP cuts dim 0, between rows,
  so it never constrains them. Every rank sums, per candidate, the block
  variances of grad² over its shard (Gefen's error measure); one all-gather;
  every rank adds the partial sums of the ranks that hold the same model part
  in rank order and applies Gefen's own scoring (``gefen_state.
  finalize_period``) and memory-safe fallback (the whole row unit), so all
  ranks get the same integers. 1-D and one-element parameters, and names
  matched by ``period_one_substrings``, keep period 1, as Gefen gives them.
* **Codebook.** One 4096-bin histogram of block-normalised gradients, in
  Gefen's arithmetic, summed over every parameter of every optimizer of a
  *codebook family* (``gefen_state.codebook_family``: Gefen's, GefenMuon's;
  all pipeline stages) with each element counted once (replicas: only the
  ranks at coordinate 0 of every ``Replicate`` mesh dim contribute),
  all-reduced as int64 (exact in any order; the families' histograms in one
  all-reduce), solved once on rank 0 with the fast exact solver
  (``codebook_solver``) and broadcast: the job has one codebook per family,
  as a single-process Gefen (or GefenMuon) has one.

GefenMuon's periods follow the same rule as Gefen's (divisors of the row
unit), which also keeps its blocks inside rows, where its sharded step
(``gefen_titan.optim.muon``) needs them.

The hook is one collective sequence for the whole container (not one per
optimizer): ranks can hold different numbers of Gefen optimizers (pipeline
stages, AdamW-only stages), and every rank must make the same calls. Every
failure (a parameter without a gradient, a layout it cannot align) is
agreed before any state changes and raised on every rank.

Limit: the per-candidate sums are added in a fixed order, but the partial
sums themselves depend on how the shards cut the blocks, so the fp64 error
values differ in their last bits between layouts. A period could therefore
only differ between layouts if two candidates' scores tie to ~1e-15
relative; the layout-invariance test checks that none does on real
gradients.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.optim import Optimizer

from gefen_titan.distributed import comm_device, is_distributed, local, raise_on_any_rank
from gefen_titan.optim import gefen_state as gs
from gefen_titan.optim.codebook_solver import codebook_from_counts

__all__ = ["AgreedBlocking", "BlockingError", "row_unit", "candidate_periods", "check_period_fits",
           "block_variance_sums", "histogram", "period_from_sums", "agreement_collectives"]

HIST_BINS = gs.K * 16  # gefen-x: num_codebooks * 16
# Bound the fp64 temporaries of the period statistics (elements per chunk).
_STATS_CHUNK = 1 << 22


class BlockingError(RuntimeError):
    """Agreed blocking cannot be set up for this model, mesh or recipe."""


# ----------------------------------------------------------------- layout
def _last_dim_cuts(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements, dims: list[int]) -> list[int]:
    """Offsets and lengths of the last-dim slices over mesh dims ``dims``."""
    out: list[int] = []
    coords = [[0] * len(mesh_shape)]
    for d in dims:
        coords = [c[:d] + [i] + c[d + 1:] for c in coords for i in range(mesh_shape[d])]
    for coord in coords:
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
        out += [local[-1], offset[-1]]
    return out


def row_unit(fqn: str, param: torch.Tensor, max_tp_degree: int = 1) -> int:
    """The largest block that no last-dim cut of any allowed layout crosses.

    Raises ``BlockingError`` for layouts whose local shard is not a box of
    whole rows of that unit (a strided shard of the last dim).
    """
    shape = tuple(param.shape)
    last = shape[-1]
    unit = last
    if isinstance(param, DTensor):
        placements = tuple(param.placements)
        dims = []
        for i, pl in enumerate(placements):
            if pl.is_shard() and pl.dim % len(shape) == len(shape) - 1:
                if type(pl) is not Shard:
                    raise BlockingError(
                        f"{fqn}: placements {placements} shard the last dimension with a strided "
                        "layout; agreed blocking needs plain Shard placements on the last dimension"
                    )
                dims.append(i)
        if dims:
            mesh_shape = tuple(param.device_mesh.shape)
            unit = math.gcd(unit, *_last_dim_cuts(shape, mesh_shape, placements, dims))
    for t in range(2, max_tp_degree + 1):
        if max_tp_degree % t == 0:
            unit = math.gcd(unit, *_last_dim_cuts(shape, (t,), (Shard(len(shape) - 1),), [0]))
    return unit


def candidate_periods(unit: int) -> list[int]:
    """Ascending divisors of the row unit (the unit itself included)."""
    small, large = [], []
    for i in range(1, math.isqrt(unit) + 1):
        if unit % i == 0:
            small.append(i)
            if i != unit // i:
                large.append(unit // i)
    return small + large[::-1]


def period_from_sums(candidates: list[int], sums: torch.Tensor, numel: int, unit: int) -> int:
    """Gefen's period among ``candidates`` from the global ``block_variance_sums``.

    Gefen's error of a candidate is sqrt(mean over blocks of the within-block
    variance of grad²); its own scoring (``gefen_state.finalize_period``) and
    memory-safe fallback (the whole row unit) pick the period. Shared by the
    agreement and by ``gefen_titan.ckpt.convert`` (which scores the AdamW
    second moment instead of a gradient's square).
    """
    results = [(p, math.sqrt(float(sums[i]) / (numel // p))) for i, p in enumerate(candidates)]
    best = gs.finalize_period(results)
    if best == 1 and gs.fallback_enabled():
        best = unit if unit >= 8 else 1  # gefen-x's fallback: the whole row
    return best


def check_period_fits(fqn: str, param: torch.Tensor, period: int) -> str | None:
    """None if blocks of ``period`` fit the param's live layout, else why not."""
    if period == 1:
        return None
    if param.dim() < 2:
        return f"{fqn}: period {period} on a {param.dim()}-D parameter (agreed blocking uses 1)"
    try:
        unit = row_unit(fqn, param)
    except BlockingError as e:
        return str(e)
    if unit % period:
        return (
            f"{fqn}: saved block period {period} crosses a shard cut of the live layout "
            f"{tuple(param.placements) if isinstance(param, DTensor) else ()} (row unit {unit}); the run that "
            "wrote the checkpoint did not declare this tensor-parallel degree: set "
            "optimizer.max_tensor_parallel_degree there, or resume at a layout whose "
            "last-dim cuts are multiples of the period"
        )
    return None


def _contributes(param: torch.Tensor) -> bool:
    """True on exactly one holder of each element of a DTensor (replicas count once).

    A DTensor on a sub-mesh (FSDP's dp mesh under FSDP x TP for a parameter
    TP leaves whole) is replicated over the other mesh dims too; the holders
    of the same shard then have the same signature group, and only the first
    of them counts it (``AgreedBlocking._dtensor_first``).
    """
    coord = param.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, pl in zip(coord, param.placements) if pl.is_replicate())


# ------------------------------------------------------------------ stats
def block_variance_sums(grad: torch.Tensor, periods: list[int], unit: int) -> torch.Tensor:
    """fp64 [len(periods)]: sum over this shard's blocks of var(grad²) per block.

    Gefen's measure is sqrt(mean over blocks of the within-block population
    variance of grad², grad² taken in fp32); the mean needs the global block
    count, so ranks exchange sums. Per block, var = E[x²] - E[x]² from the
    block's sums of x and x² (fp64); each candidate's block sums are built
    from those of the largest smaller candidate that divides it, so all
    candidates together cost about two passes over the shard instead of one
    each. Every block lies inside one shard, so its sums do not depend on the
    layout. Chunks are cut at multiples of the row unit, which every
    candidate divides.
    """
    flat = grad.detach().reshape(-1)
    out = torch.zeros(len(periods), dtype=torch.float64, device=flat.device)
    if flat.numel() == 0:
        return out
    step = max(unit, (_STATS_CHUNK // unit) * unit)
    for start in range(0, flat.numel(), step):
        sq = flat[start:start + step].float().square().double()
        sums = {1: (sq, sq * sq)}
        for i, p in enumerate(periods):
            if p == 1:
                continue  # a one-element block has no variance
            q = max(d for d in sums if p % d == 0)
            s1, s2 = sums[q]
            s1, s2 = s1.view(-1, p // q).sum(dim=1), s2.view(-1, p // q).sum(dim=1)
            sums[p] = (s1, s2)
            mean = s1 / p
            out[i] += (s2 / p - mean * mean).clamp_min_(0).sum()
    return out


def histogram(grad: torch.Tensor, period: int) -> torch.Tensor:
    """int64 [4096] counts of block-normalised values, Gefen's arithmetic.

    As ``gefen.gefen.learn_gefen_exact_codebook_from_grad_periods``: fp32
    blocks divided by their absmax (0 where it is 0), bin ``floor((x + 1) /
    (2 / 4096))`` clamped to the range.
    """
    flat = grad.detach().reshape(-1)
    counts = torch.zeros(HIST_BINS, dtype=torch.int64, device=flat.device)
    if flat.numel() == 0:
        return counts
    bin_width = 2.0 / float(HIST_BINS)
    step = max(1, (1 << 28) // period) * period
    for start in range(0, flat.numel(), step):
        blocks = flat[start:start + step].float().view(-1, period)
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        normalized = torch.where(absmax > 0, blocks / absmax, torch.zeros_like(blocks)).reshape(-1)
        idx = torch.floor((normalized + 1.0) / bin_width).to(torch.long).clamp(0, HIST_BINS - 1)
        counts += torch.bincount(idx, minlength=HIST_BINS)
    return counts


# -------------------------------------------------------------- agreement
@dataclass
class _Param:
    fqn: str
    param: torch.Tensor
    optim: Optimizer
    unit: int  # 0: fixed period 1
    candidates: list[int]


def _all_gather(t: torch.Tensor, world: int) -> torch.Tensor:
    """[world, *t.shape] on CPU (list all_gather: gloo and NCCL both have it)."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return torch.stack([x.cpu() for x in parts])


def agreement_collectives(width: int) -> list[tuple[str, str, torch.dtype, int]]:
    """The collectives ``AgreedBlocking.maybe_agree`` makes on a first step that succeeds.

    In order, ``(what, op, dtype, elements each rank sends)``; ``width`` is
    the stage's candidate count (the sum of ``len(candidates)`` over its
    searched parameters). An all-gather delivers ``world`` times its
    payload to every rank. The histograms and codebooks are those of every
    codebook family (``gefen_state.CODEBOOK_FAMILIES``), whether or not the
    job has optimizers of each. Kept beside the code it describes: the scale plan
    sizes the first step from it, and a test records the real calls
    against it.
    """
    families = gs.CODEBOOK_FAMILIES
    return [
        ("error check: parameters", "all_reduce", torch.int64, 1),
        ("stage signature", "all_gather", torch.int64, 1),
        ("candidate width", "all_gather", torch.int64, 1),
        ("block-variance sums", "all_gather", torch.float64, width),
        ("error check: histogram", "all_reduce", torch.int64, 1),
        ("histograms", "all_reduce", torch.int64, families * HIST_BINS),
        ("error check: codebook", "all_reduce", torch.int64, 1),
        ("codebooks", "broadcast", torch.float32, families * gs.K),
    ]


class AgreedBlocking:
    """Pre-sets the periods and codebooks of Gefen and GefenMuon from global statistics, once.

    ``maybe_agree(optimizers)`` is called on every rank before each step of
    the container; it does its collectives only while ``needed`` (a fresh
    optimizer), and is switched off by a checkpoint load that restored state.
    """

    def __init__(self, max_tp_degree: int = 1) -> None:
        if max_tp_degree < 1:
            raise ValueError("optimizer.max_tensor_parallel_degree must be >= 1")
        self.max_tp_degree = max_tp_degree
        self.needed = True

    # Gefen keeps period 1 for these (gefen.Gefen._resolve_automatic_period).
    @staticmethod
    def _fixed_one(optim: Optimizer, fqn: str, p: torch.Tensor) -> bool:
        opts = gs.options(optim)
        if p.dim() <= 1 or p.numel() == 1:
            return True
        if opts["force_2d_period_one"] and p.dim() == 2:
            return True
        return any(s in fqn.lower() for s in opts["period_one_substrings"])

    def _params(self, optimizers: Iterable[Optimizer]) -> list[_Param]:
        out = []
        for optim in optimizers:
            for fqn, p, _ in gs.named_params(optim):
                if self._fixed_one(optim, fqn, p):
                    out.append(_Param(fqn, p, optim, 0, [1]))
                else:
                    unit = row_unit(fqn, p, self.max_tp_degree)
                    out.append(_Param(fqn, p, optim, unit, candidate_periods(unit)))
        return out

    def period_candidates(self, optimizers: Iterable[Optimizer]) -> list[tuple[str, torch.Tensor, int, list[int]]]:
        """(fqn, param, row unit, candidate periods) per Gefen parameter, in agreement order.

        The row unit is 0 for a parameter that keeps period 1 (candidates
        ``[1]``). Needs no gradient (shapes and placements only), so a plan
        can apply the rules to a model on the meta device.
        """
        return [(q.fqn, q.param, q.unit, list(q.candidates)) for q in self._params(optimizers)]

    def maybe_agree(self, optimizers: list[Optimizer]) -> None:
        if not self.needed:
            return
        what = "cannot agree Gefen block periods and codebook on the first step"
        params, error = [], None
        try:
            params = self._params(optimizers)
            missing = [q.fqn for q in params if q.param.grad is None]
            if missing:
                error = (
                    f"{len(missing)} Gefen parameter(s) have no gradient on the first step "
                    f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); agreed blocking "
                    "learns every period from the first step's gradients. Freeze them out of the "
                    "optimizer, or set optimizer.blocking = \"per_rank\""
                )
        except BlockingError as e:
            error = str(e)
        raise_on_any_rank(error, what, BlockingError)

        group = self._stage_group(params)
        counts_here = [self._counts_here(q, group) for q in params]
        periods = self._agree_periods(params, counts_here, group)
        counts, error = None, None
        try:
            counts = torch.zeros(gs.CODEBOOK_FAMILIES, HIST_BINS, dtype=torch.int64)
            for q, period, here in zip(params, periods, counts_here):
                if here:
                    counts[gs.codebook_family(q.optim)] += histogram(local(q.param.grad), period).cpu()
        except (RuntimeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        raise_on_any_rank(error, what, BlockingError)
        codebooks = self._solve(counts)
        for q, period in zip(params, periods):
            gs.set_period(q.optim, q.param, period)
        for optim in optimizers:
            codebook = codebooks[gs.codebook_family(optim)]
            if codebook is None:
                continue
            device = next((local(p).device for _, p, _ in gs.named_params(optim)), torch.device("cpu"))
            gs.set_codebook(optim, codebook.to(device).clone())
        self.needed = False

    @staticmethod
    def _stage_group(params: list[_Param]) -> list[int]:
        """World ranks holding the same model part as this rank, ascending.

        Ranks of one pipeline stage have the same parameters (names, shapes,
        candidates); a hash of that list identifies the stage.
        """
        signature = hashlib.sha1(
            repr([(q.fqn, tuple(q.param.shape), q.candidates) for q in params]).encode()
        ).digest()
        sig = int.from_bytes(signature[:8], "little", signed=True)
        if not is_distributed():
            return [0]
        sigs = _all_gather(torch.tensor([sig], dtype=torch.int64, device=comm_device()), dist.get_world_size())
        return [r for r in range(dist.get_world_size()) if int(sigs[r, 0]) == sig]

    @staticmethod
    def _counts_here(q: _Param, group: list[int]) -> bool:
        """Whether this rank counts its shard of ``q`` (every element exactly once).

        Plain tensors are whole on every rank of the stage: the first counts.
        A DTensor counts at coordinate 0 of its ``Replicate`` mesh dims, and
        only on the copy of its mesh that holds the stage's first rank: a
        DTensor on a sub-mesh (FSDP's mesh under FSDP x TP, for a parameter
        TP leaves whole) is replicated over the other copies.
        """
        rank = dist.get_rank() if is_distributed() else 0
        if not isinstance(q.param, DTensor):
            return rank == group[0]
        mesh = q.param.device_mesh
        if not _contributes(q.param):
            return False
        return group[0] in mesh.mesh.flatten().tolist() if is_distributed() else True

    def _agree_periods(self, params: list[_Param], counts_here: list[bool], group: list[int]) -> list[int]:
        searched = [(q, here) for q, here in zip(params, counts_here) if q.unit]
        sums = [
            block_variance_sums(local(q.param.grad), q.candidates, q.unit).cpu() if here
            else torch.zeros(len(q.candidates), dtype=torch.float64)
            for q, here in searched
        ]
        flat = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64)
        if is_distributed():
            device, world = comm_device(), dist.get_world_size()
            width = int(_all_gather(torch.tensor([flat.numel()], device=device), world).max())
            mine = torch.zeros(width, dtype=torch.float64, device=device)
            mine[: flat.numel()] = flat.to(device)
            rows = _all_gather(mine, world)
        else:
            rows = flat.reshape(1, -1)
        by_param, offset = {}, 0
        for q, _ in searched:
            n = len(q.candidates)
            # Fixed order: the stage's ranks in ascending rank order (ranks
            # that do not count a shard sent zeros, which add exactly).
            total = torch.zeros(n, dtype=torch.float64)
            for r in group:
                total = total + rows[r, offset:offset + n]
            offset += n
            by_param[id(q)] = period_from_sums(q.candidates, total, q.param.numel(), q.unit)
        return [by_param.get(id(q), 1) for q in params]

    def _solve(self, counts: torch.Tensor) -> list[torch.Tensor | None]:
        """Each family's codebook from its global histogram (``counts``: [families,
        bins]): solved on rank 0, broadcast.

        None for a family with no elements in the job (it learns none then).
        """
        if not is_distributed():
            return [codebook_from_counts(c) if int(c.sum()) else None for c in counts]
        device = comm_device()
        total = counts.to(device)
        dist.all_reduce(total)
        total = total.cpu()
        present = [bool(int(c.sum())) for c in total]
        payload = torch.zeros(len(total), gs.K, dtype=torch.float32, device=device)
        message = None
        if dist.get_rank() == 0:
            try:
                for f, c in enumerate(total):
                    if present[f]:
                        payload[f].copy_(codebook_from_counts(c))
            except (ValueError, RuntimeError) as e:
                message = f"{type(e).__name__}: {e}"
        raise_on_any_rank(message, "cannot solve the job's Gefen codebook", BlockingError)
        dist.broadcast(payload, src=0)
        return [payload[f].cpu() if present[f] else None for f in range(len(total))]
