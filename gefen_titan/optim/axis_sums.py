"""Sums of a non-negative tensor along one axis, exact at every layout: fixed point, added as integers.

The factored second moment keeps, per matrix, the mean of grad² over each
row and over each column. Under FSDP, TP or EP a row or a column is cut
between ranks, at cuts that change with the layout; fp32 or fp64 partial
sums added across ranks round differently for each cut, so the state would
depend on the mesh. Here every value is put on a fixed-point grid common to
its whole row (or column) and the grid values are added as int64, which is
exact in any order and grouping; the all-reduce then adds integers. The same
integers come out at every layout and world size, one rank included.

**The grid.** x ≥ 0. For each slice (one row, one column) ``exponents``
gives a one-byte code of e with max(x) < 2^e over the slice's local part
(frexp's exponent, clamped below at ``E_MIN``: a slice whose values are all
below 2^-125 is on a coarser grid than it could be, and is zero for any
second moment anyway), and the ranks that share the slice agree on the
largest (an all-reduce MAX of uint8: exact in any order). With n the
slice's length over all ranks, each value is scaled by 2^(F - e),
F = ``fraction_bits(n)`` = 62 - ceil(log2 n) (exact: a power of two, in fp64,
which holds every fp32 value scaled so), floored and added as one int64.

**Overflow.** Each floored value is < 2^F, so n of them add to < 2^62: no
int64 sum of any part of a slice, on any rank or across ranks, overflows.

**Error bound.** Flooring loses less than 2^(e - F) per value, so the sum is
low by less than n · 2^(e - F) ≤ n² · 2^(e - 62), while the sum is at least
its largest value, ≥ 2^(e - 1): a relative error below n² · 2^-61. For a
slice of 2^17 values (Llama 3's vocabulary, 128,256 rows) that is 2^-27,
under fp32's own rounding of the mean (2^-24); it reaches fp32's at
n = 2^18.5. The result is read back in fp64 and rounded to fp32 by the
caller, as gefen-x's fp32 sum is, but from the same integer on every layout.

**Why one int64, not limbs.** The factored step all-reduces these sums on
every step, beside the gradient: one byte of exponent and eight of sum per
slice (the agreement's block sums, ``block_stats``, use four 31-bit limbs:
they run once). ``benchmarks/scale_factored.py`` holds the traffic to the
gradient's.

**Non-finite values.** A slice holding an inf or a nan gets the code
``NONFINITE`` (above every finite one, so the MAX carries it to every rank)
and reads back as nan, as an fp32 sum of it would. A rank holding no value
of a slice sends ``NO_DATA`` (below every other).
"""

from __future__ import annotations

import math

import torch

__all__ = ["E_MIN", "NONFINITE", "NO_DATA", "EXPONENT_DTYPE", "SUM_DTYPE", "fraction_bits", "exponents", "sums",
           "values"]

E_MIN = -125  # frexp exponents below it are clamped up (see the module doc)
E_MAX = 128  # of the largest finite fp32 square
NO_DATA = 0  # the code of a rank that holds no value of the slice
NONFINITE = 255  # the code of a slice that holds an inf or a nan
EXPONENT_DTYPE = torch.uint8
SUM_DTYPE = torch.int64
_OFFSET = 1 - E_MIN  # code = e + _OFFSET: E_MIN -> 1, E_MAX -> 254


def fraction_bits(n: int) -> int:
    """F for a slice of ``n`` values over all ranks: 62 - ceil(log2 n), so that n values < 2^F add up below 2^62."""
    return 62 - max(0, math.ceil(math.log2(max(1, n))))


def exponents(x: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes: per slice along ``dim`` (that dim reduced), of e with max(x) < 2^e (``E_MIN`` at least)."""
    shape = list(x.shape)
    del shape[dim]
    if x.shape[dim] == 0:
        return torch.full(shape, NO_DATA, dtype=EXPONENT_DTYPE, device=x.device)
    top = x.amax(dim=dim)
    e = torch.frexp(top.float()).exponent.clamp_(E_MIN, E_MAX)
    codes = (e + _OFFSET).to(EXPONENT_DTYPE)
    bad = ~torch.isfinite(x).all(dim=dim)
    return codes.masked_fill_(bad, NONFINITE)


def _shift(codes: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(finite mask, F - e per slice; 0 where not finite or no data)."""
    e = codes.to(torch.int32) - _OFFSET
    finite = (codes != NONFINITE) & (codes != NO_DATA)
    return finite, torch.where(finite, fraction_bits(n) - e, 0)


def sums(x: torch.Tensor, dim: int, codes: torch.Tensor, n: int) -> torch.Tensor:
    """int64: per slice along ``dim``, the sum of floor(x · 2^(F - e)) over this part of the slice.

    ``codes`` are the slices' agreed exponents (``exponents`` all-reduced with
    MAX), shaped like ``x`` with ``dim`` reduced; ``n`` is the slices' length
    over all ranks. The sums of any split of a slice add up to the sum of
    the whole.
    """
    shape = list(x.shape)
    del shape[dim]
    if x.numel() == 0:
        return torch.zeros(shape, dtype=SUM_DTYPE, device=x.device)
    finite, shift = _shift(codes, n)
    # 2^(F - e) per slice (a power of two, within fp64's range: F - e <= 62 - E_MIN), 0 where the slice is
    # not finite: one small pow, then a broadcast multiply, exact in fp64 for every fp32 value.
    scale = torch.where(finite, torch.exp2(shift.double()), 0.0)
    scaled = x.double().mul_(scale.unsqueeze(dim)).floor_()
    if not finite.all():  # inf * 0 is nan, whose cast to int64 is undefined: those slices read back as nan
        scaled.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return scaled.to(SUM_DTYPE).sum(dim=dim)


def values(total: torch.Tensor, codes: torch.Tensor, n: int) -> torch.Tensor:
    """fp64: the sums that ``total`` (``sums`` added over ranks) and ``codes`` stand for; nan where not finite."""
    finite, shift = _shift(codes, n)
    out = torch.ldexp(total.double(), (-shift).double())  # one rounding: the integer to fp64
    return out.masked_fill_(codes == NONFINITE, float("nan"))
