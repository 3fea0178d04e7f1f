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
  so it never constrains them (these rules: ``block_periods``). Every rank
  sums, per candidate, the block variances of grad² over its shard (Gefen's
  error measure) in exact int64
  fixed point, on a grid set by the parameter's largest grad² (one small
  all-reduce MAX of exponents first; ``block_stats``), and one all-reduce
  adds the integers: exact in any order, so the sums are the same integers
  at every layout and world size, and a rank receives O(candidates) bytes
  whatever the world size. Every rank then applies Gefen's own scoring
  (``gefenx.finalize_period``) and memory-safe fallback (the whole row
  unit), so all ranks get the same periods. Pipeline stages hold different
  parameters: each stage has its own segment of the all-reduced vectors
  (its ranks write there, every other rank zeros), laid out from one small
  all-gather of every rank's stage signature and sizes. 1-D and one-element
  parameters, and names matched by ``period_one_substrings``, keep period
  1, as Gefen gives them.
* **Codebook.** One 4096-bin histogram of block-normalised gradients, in
  Gefen's arithmetic, summed over every parameter of every optimizer of a
  *codebook family* (its registry entry's ``codebook_family``: Gefen's, GefenMuon's;
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
failure (a parameter without a gradient, a layout it cannot align, a
shard DCP would write at other offsets than FSDP2 holds it:
``distributed.layout.dcp_disagreement``) is agreed before any state
changes and raised on every rank.

Traffic received per rank on the first step (``agreement_collectives``;
an all-reduce counted as its payload): 24 B times the world size for the
stage layout (24 KiB at 1,024 ranks), 8 B per searched parameter and 32 B
per candidate of every stage (the model's candidates, whatever the world
size), the histograms (64 KiB) and the codebooks (2 KiB).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torchtitan.tools.logging import logger

from gefen_titan.distributed import comm_device, is_distributed, local, raise_on_any_rank
from gefen_titan.distributed.layout import dcp_disagreement, holds_first_copy
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.block_periods import BlockingError, candidate_periods, period_from_sums, row_unit
from gefen_titan.optim.block_stats import (
    HIST_BINS,
    LIMBS,
    NO_DATA,
    block_variance_limbs,
    check_numel,
    grad_exponent,
    histogram,
    limbs_to_sums,
)
from gefen_titan.optim.codebook_solver import codebook_from_counts

__all__ = ["AgreedBlocking", "agreement_collectives"]


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


def agreement_collectives(width: int, searched: int, families: int) -> list[tuple[str, str, torch.dtype, int]]:
    """The collectives ``AgreedBlocking.maybe_agree`` makes on a first step that succeeds.

    In order, ``(what, op, dtype, elements each rank sends)``; ``width`` is
    the job's candidate count (the sum of ``len(candidates)`` over the
    searched parameters of every distinct pipeline stage, each stage once)
    and ``searched`` the number of those parameters. An all-gather delivers
    ``world`` times its payload to every rank; every other collective's
    payload is the same at any world size. The histograms and codebooks are
    those of every codebook family (``families``: the registry's
    ``codebook_families()``), whether or not the job has optimizers of each. Kept beside the code it
    describes: the scale plan sizes the first step from it, and a test
    records the real calls against it.
    """
    return [
        ("error check: parameters", "all_reduce", torch.int64, 1),
        ("stage layout: signature, candidates, searched parameters", "all_gather", torch.int64, 3),
        ("gradient exponents (max)", "all_reduce", torch.int64, searched),
        ("block-variance sums (int64 fixed point)", "all_reduce", torch.int64, LIMBS * width),
        ("error check: histogram", "all_reduce", torch.int64, 1),
        ("histograms", "all_reduce", torch.int64, families * HIST_BINS),
        ("error check: codebook", "all_reduce", torch.int64, 1),
        ("codebooks", "broadcast", torch.float32, families * gx.K),
    ]


@dataclass(frozen=True)
class _StageLayout:
    """This rank's stage and its segments of the all-reduced vectors.

    ``group``: the world ranks holding the same model part, ascending.
    Segments (offset, and the job's total length): one exponent per searched
    parameter, one row of limbs per candidate, stages in the order of their
    first rank.
    """

    group: list[int]
    searched_offset: int
    searched_total: int
    width_offset: int
    width_total: int


class AgreedBlocking:
    """Pre-sets the periods and codebooks of Gefen and GefenMuon from global statistics, once.

    ``maybe_agree(optimizers)`` is called on every rank before each step of
    the container; it does its collectives only while ``needed`` (a fresh
    optimizer), and is switched off by a checkpoint load that restored state.
    ``family_of`` gives an optimizer's codebook family, an index below
    ``families`` (the container passes its registry entry's
    ``codebook_family``): each family learns one codebook for the job from
    its own optimizers' gradients. Without them it plans periods only
    (``period_candidates``).
    """

    def __init__(self, max_tp_degree: int = 1, family_of: Callable[[Optimizer], int] | None = None,
                 families: int = 0) -> None:
        if max_tp_degree < 1:
            raise ValueError("optimizer.blocking.max_tensor_parallel_degree must be >= 1")
        self.max_tp_degree = max_tp_degree
        self.family_of, self.families = family_of, families
        self.needed = True

    # Gefen keeps period 1 for these (gefen.Gefen._resolve_automatic_period).
    @staticmethod
    def _fixed_one(optim: Optimizer, fqn: str, p: torch.Tensor) -> bool:
        opts = gx.options(optim)
        if p.dim() <= 1 or p.numel() == 1:
            return True
        if opts["force_2d_period_one"] and p.dim() == 2:
            return True
        return any(s in fqn.lower() for s in opts["period_one_substrings"])

    def _params(self, optimizers: Iterable[Optimizer]) -> list[_Param]:
        out = []
        for optim in optimizers:
            for fqn, p, _ in gx.named_params(optim):
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
        if self.family_of is None:
            raise TypeError("AgreedBlocking without family_of plans periods only; the container's agrees")
        what = "cannot agree block periods and codebooks on the first step"
        params, error = [], None
        try:
            params = self._params(optimizers)
            missing = [q.fqn for q in params if q.param.grad is None]
            too_big = [m for q in params if q.unit and (m := check_numel(q.fqn, q.param.numel()))]
            misplaced = [m for q in params if (m := dcp_disagreement(q.fqn, q.param))]
            if misplaced:
                error = misplaced[0]
            elif too_big:
                error = too_big[0]
            elif missing:
                error = (
                    f"{len(missing)} parameter(s) of agreed blocking have no gradient on the first step "
                    f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); agreed blocking "
                    "learns every period from the first step's gradients. Freeze them out of the "
                    "optimizer, or set optimizer.blocking.mode = \"per_rank\""
                )
        except BlockingError as e:
            error = str(e)
        raise_on_any_rank(error, what, BlockingError)

        layout = self._stage_layout(params)
        counts_here = [self._counts_here(q, layout.group) for q in params]
        periods = self._agree_periods(params, counts_here, layout)
        counts, error = None, None
        try:
            counts = torch.zeros(self.families, HIST_BINS, dtype=torch.int64)
            for q, period, here in zip(params, periods, counts_here):
                if here:
                    counts[self.family_of(q.optim)] += histogram(local(q.param.grad), period).cpu()
        except (RuntimeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        raise_on_any_rank(error, what, BlockingError)
        codebooks = self._solve(counts)
        for q, period in zip(params, periods):
            gx.set_period(q.optim, q.param, period)
        for optim in optimizers:
            codebook = codebooks[self.family_of(optim)]
            if codebook is None:
                continue
            device = next((local(p).device for _, p, _ in gx.named_params(optim)), torch.device("cpu"))
            gx.set_codebook(optim, codebook.to(device).clone())
        self.needed = False
        # The one line that says the agreement ran (a torchft group that joined late must not).
        logger.info(f"Agreed blocking: block periods of {sum(1 for q in params if q.unit)} parameter(s) and the "
                    "codebook(s) set from this step's gradients")

    @staticmethod
    def _stage_layout(params: list[_Param]) -> _StageLayout:
        """This rank's stage and segments, from one all-gather of (signature, width, searched).

        Ranks of one pipeline stage have the same parameters (names, shapes,
        candidates); a hash of that list identifies the stage. The gather is
        three int64 per rank (24 KiB received per rank at 1,024 ranks): the
        only part of the agreement's traffic that grows with the world size.
        """
        signature = hashlib.sha1(
            repr([(q.fqn, tuple(q.param.shape), q.candidates) for q in params]).encode()
        ).digest()
        sig = int.from_bytes(signature[:8], "little", signed=True)
        searched = [q for q in params if q.unit]
        width = sum(len(q.candidates) for q in searched)
        if not is_distributed():
            return _StageLayout([0], 0, len(searched), 0, width)
        world = dist.get_world_size()
        rows = _all_gather(torch.tensor([sig, width, len(searched)], dtype=torch.int64, device=comm_device()),
                           world).tolist()
        stages: dict[int, tuple[int, int]] = {}  # signature -> (width, searched), in order of first rank
        for s, w, n in rows:
            stages.setdefault(s, (w, n))
        offsets = {}
        w_off = n_off = 0
        for s, (w, n) in stages.items():
            offsets[s] = (n_off, w_off)
            n_off, w_off = n_off + n, w_off + w
        group = [r for r in range(world) if rows[r][0] == sig]
        return _StageLayout(group, offsets[sig][0], n_off, offsets[sig][1], w_off)

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
        # Replicas (HSDP's, a sub-mesh's copies) count once: coordinate 0 of every Replicate dim.
        if not holds_first_copy(q.param):
            return False
        return group[0] in mesh.mesh.flatten().tolist() if is_distributed() else True

    def _agree_periods(self, params: list[_Param], counts_here: list[bool], layout: _StageLayout) -> list[int]:
        # Integer collectives only (MAX, SUM): exact in any order, so the
        # result does not depend on the world size or on who holds what.
        searched = [(q, here) for q, here in zip(params, counts_here) if q.unit]
        device = comm_device() if is_distributed() else torch.device("cpu")
        exps = torch.full((layout.searched_total,), NO_DATA, dtype=torch.int64)
        for k, (q, here) in enumerate(searched):
            if here:
                exps[layout.searched_offset + k] = grad_exponent(local(q.param.grad))
        if is_distributed():
            exps = exps.to(device)
            dist.all_reduce(exps, op=dist.ReduceOp.MAX)
        exponents = exps.cpu().tolist()[layout.searched_offset:layout.searched_offset + len(searched)]
        limbs = torch.zeros(layout.width_total, LIMBS, dtype=torch.int64, device=device)
        offset = layout.width_offset
        for (q, here), e in zip(searched, exponents):
            n = len(q.candidates)
            if here:  # ranks that do not count a shard send zeros, which add exactly
                limbs[offset:offset + n] = block_variance_limbs(local(q.param.grad), q.candidates, q.unit, e).to(device)
            offset += n
        if is_distributed():
            dist.all_reduce(limbs)
        limbs = limbs.cpu()
        by_param, offset = {}, layout.width_offset
        for (q, _), e in zip(searched, exponents):
            n = len(q.candidates)
            total = limbs_to_sums(limbs[offset:offset + n], [e] * n)
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
        payload = torch.zeros(len(total), gx.K, dtype=torch.float32, device=device)
        message = None
        if dist.get_rank() == 0:
            try:
                for f, c in enumerate(total):
                    if present[f]:
                        payload[f].copy_(codebook_from_counts(c))
            except (ValueError, RuntimeError) as e:
                message = f"{type(e).__name__}: {e}"
        raise_on_any_rank(message, "cannot solve the job's codebooks", BlockingError)
        dist.broadcast(payload, src=0)
        return [payload[f].cpu() if present[f] else None for f in range(len(total))]
