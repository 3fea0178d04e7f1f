"""The agreement's per-shard statistics: block-variance sums in exact fixed point, histograms.

Every rank reduces its gradient shards to a few numbers per candidate
period, and the agreement adds those numbers over the ranks. For the result
to be the same integers at every layout, the addition must not depend on
which rank holds which blocks nor on the order the ranks' numbers are
added in. fp64 sums cannot promise that (rounding depends on the order), so
each block's variance is put on a fixed-point grid common to the whole
parameter and the grid values are summed as integers, which is exact in any
order and grouping; the all-reduce then adds them like any int64 tensor.

**The grid.** Every value of x = grad² (fp32 square, as Gefen takes it) lies
in [0, G] where G is the parameter's largest; a block's population variance
is then at most G²/4 (Popoviciu). ``grad_exponent`` gives g with G < 2^g
(one amax pass, all-reduced with MAX: exact in any order), and with
E = 2g every block variance v satisfies v < 2^E, with a 4x margin for the
rounding of the fp64 variance. v is scaled by 2^(F - E), F = ``FRACTION_BITS``
= 124 (an exact power-of-two scaling), floored, and split into
``LIMBS`` = 4 limbs of 31 bits (each exact in fp64 and in int64).

**Error bound.** Flooring loses less than 2^(E - F) per block, so the
integer sum is below the exact sum T of the fp64 block variances by less
than N · 2^(E - F) for N blocks; since 2^E ≤ 4 G², that is < N · G² · 2^-122,
i.e. a relative error below 2^-122 · G² / (T / N) (G² against the mean block
variance). It is under fp64's own rounding (2^-53) unless the largest grad²
squared exceeds the mean block variance by 2^69, far beyond any gradient;
the fp64 ``.sum()`` it replaces had an error of the same order as fp64's
and an order-dependent one. The sum is converted to fp64 once, correctly
rounded, from the exact integer.

**Overflow.** A limb is < 2^31; summed over N blocks it stays below 2^63 for
N < 2^32 blocks. N ≤ numel / 2 (period 1 is never scored), so a parameter
must have fewer than 2^33 elements (``MAX_NUMEL``; Llama 3 405B's largest
has 2.1e9); ``check_numel`` says so before any collective.
"""

from __future__ import annotations

import math

import torch

from gefen_titan.optim import gefenx as gx

__all__ = ["HIST_BINS", "LIMBS", "FRACTION_BITS", "MAX_NUMEL", "NONFINITE", "NO_DATA", "grad_exponent",
           "block_variance_limbs", "fixed_point_limbs", "limbs_to_sums", "block_variance_sums", "histogram",
           "check_numel"]

HIST_BINS = gx.K * 16  # gefen-x: num_codebooks * 16
LIMB_BITS = 31
LIMBS = 4
FRACTION_BITS = LIMB_BITS * LIMBS
MAX_NUMEL = 1 << 33
# Exponent codes for the MAX all-reduce: above any finite exponent (an inf or
# nan gradient: its sums become nan, as fp64 arithmetic made them), and
# below any (a rank that holds no element of the parameter).
NONFINITE = 1 << 40
NO_DATA = -(1 << 40)
# Bound the fp64 temporaries of the period statistics (elements per chunk).
_STATS_CHUNK = 1 << 22


def check_numel(fqn: str, numel: int) -> str | None:
    """None if a parameter's block-variance sums fit the int64 limbs, else why not."""
    if numel < MAX_NUMEL:
        return None
    return (f"{fqn}: {numel} elements; agreed blocking sums block variances in int64 fixed point, exact up to "
            f"{MAX_NUMEL} elements per parameter. Split the parameter, or set optimizer.blocking.mode = \"per_rank\"")


def grad_exponent(grad: torch.Tensor) -> int:
    """g with max(grad²) < 2^g (frexp's exponent; 0 for an all-zero or empty shard).

    ``NONFINITE`` if the shard holds an inf or a nan (or grad² overflows fp32).
    """
    flat = grad.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    top = float(flat.float().abs().amax().square())  # = max of the fp32 squares (rounding is monotone)
    if not math.isfinite(top):
        return NONFINITE
    return math.frexp(top)[1]


def fixed_point_limbs(values: torch.Tensor, exponent: int) -> torch.Tensor:
    """int64 [LIMBS]: the sum of floor(v · 2^(F - 2·exponent)) over fp64 ``values``, as limbs.

    Limb j carries the bits [31 j, 31 j + 31) of each value, summed over the
    values (no carries: the limbs are added independently, so the result is
    the same for any split of ``values`` into parts whose limbs are added).
    Every value must be in [0, 2^(2·exponent)). ``limbs_to_sums`` reads the
    total back.
    """
    shift = FRACTION_BITS - 2 * exponent
    # Two power-of-two factors: 2^shift alone can leave fp64's range; each
    # product is exact (no overflow: the result is < 2^F; a result too small
    # to be normal floors to 0 anyway).
    x = values.double() * 2.0 ** (shift // 2) * 2.0 ** (shift - shift // 2)
    # fp64 sums of integers below 2^31 are exact (in any order) while the
    # total stays below 2^53: up to 2^22 values; beyond, sum in int64.
    exact_in_fp64 = x.numel() <= 1 << 22
    out = torch.empty(LIMBS, dtype=torch.int64, device=values.device)
    for j in reversed(range(LIMBS)):
        unit = 2.0 ** (LIMB_BITS * j)
        limb = torch.floor(x * (1.0 / unit)) if j else x.floor()
        if j:
            x.sub_(limb * unit)  # exact: the bits of x below 2^(31 j)
        out[j] = limb.sum() if exact_in_fp64 else limb.to(torch.int64).sum()
    return out


def limbs_to_sums(limbs: torch.Tensor, exponents: list[int]) -> torch.Tensor:
    """fp64 [n]: each row of ``limbs`` ([n, LIMBS] int64) read back at its exponent.

    The exact integer sum_j limb_j · 2^(31 j) is rounded to fp64 once
    (Python's int-to-float rounds correctly) and scaled exactly.
    """
    rows = limbs.cpu().tolist()
    out = []
    for row, e in zip(rows, exponents):
        if e >= NONFINITE:
            out.append(math.nan)
            continue
        total = sum(v << (LIMB_BITS * j) for j, v in enumerate(row))
        out.append(math.ldexp(float(total), 2 * e - FRACTION_BITS))
    return torch.tensor(out, dtype=torch.float64)


def block_variance_limbs(grad: torch.Tensor, periods: list[int], unit: int, exponent: int) -> torch.Tensor:
    """int64 [len(periods), LIMBS]: this shard's block variances of grad², in fixed point.

    Gefen's measure is sqrt(mean over blocks of the within-block population
    variance of grad², grad² taken in fp32); the mean needs the global block
    count, so ranks exchange sums. Per block, var = E[x²] - E[x]² from the
    block's sums of x and x² (fp64); each candidate's block sums are built
    from those of the largest smaller candidate that divides it, so all
    candidates together cost about two passes over the shard instead of one
    each. Every block lies inside one shard, so its variance does not depend
    on the layout, and ``fixed_point_limbs`` adds the variances exactly.
    Chunks are cut at multiples of the row unit, which every candidate
    divides. ``exponent`` is the parameter's ``grad_exponent`` over all its
    shards (a ``NONFINITE`` one gives zeros: the sums are nan whatever they hold).
    """
    flat = grad.detach().reshape(-1)
    out = torch.zeros(len(periods), LIMBS, dtype=torch.int64, device=flat.device)
    if flat.numel() == 0 or exponent >= NONFINITE:
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
            out[i] += fixed_point_limbs((s2 / p - mean * mean).clamp_min_(0), exponent)
    return out


def block_variance_sums(grad: torch.Tensor, periods: list[int], unit: int) -> torch.Tensor:
    """fp64 [len(periods)]: the sum over a whole tensor's blocks of var(grad²) per block.

    The agreement's arithmetic on one tensor (``gefen_titan.ckpt_tools.convert``
    scores an AdamW second moment with it): the same numbers a job's
    agreement computes for that tensor at any layout.
    """
    e = grad_exponent(grad)
    return limbs_to_sums(block_variance_limbs(grad, periods, unit, e), [e] * len(periods))


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
