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
gives e with max(x) < 2^e over the slice's local part (frexp's exponent),
and the ranks that share the slice agree on the largest (an all-reduce
MAX: exact in any order). Each value is scaled by 2^(F - e), F =
``FRACTION_BITS`` = 62 (exact: a power of two, in fp64, which holds every
fp32 value scaled so), floored, and split into ``LIMBS`` = 2 limbs of 31
bits, each added as int64.

**Error bound.** Flooring loses less than 2^(e - F) per value, so for n
values the sum is low by less than n · 2^(e - 62) ≤ n · 2^-61 · max(x): at
most 2^-29 of the largest value even for n = 2^32 values, under fp32's own
rounding of the mean (2^-24). The result is read back in fp64 and rounded to
fp32 by the caller, as gefen-x's fp32 sum is, but from the same integers on
every layout.

**Overflow.** A limb is < 2^31; summed over n < 2^32 values it stays below
2^63: rows and columns of fewer than 2^32 elements (a matrix with a longer
one would hold over 2^32 elements in one row or column alone).

**Non-finite values.** A slice holding an inf or a nan gets the exponent
``NONFINITE`` (larger than any finite one, so the MAX carries it to every
rank) and reads back as nan, as an fp32 sum of it would.
"""

from __future__ import annotations

import torch

__all__ = ["LIMBS", "FRACTION_BITS", "NONFINITE", "NO_DATA", "exponents", "limbs", "values"]

LIMB_BITS = 31
LIMBS = 2
FRACTION_BITS = LIMB_BITS * LIMBS
# Exponent codes (int32, for the MAX all-reduce): above any finite fp32
# exponent (the slice holds an inf or a nan), and below any (a rank that holds
# no element of the slice).
NONFINITE = 1 << 20
NO_DATA = -(1 << 20)


def exponents(x: torch.Tensor, dim: int) -> torch.Tensor:
    """int32: per slice along ``dim`` (that dim reduced), e with max(x) < 2^e (0 for all zeros)."""
    shape = list(x.shape)
    del shape[dim]
    if x.shape[dim] == 0:
        return torch.full(shape, NO_DATA, dtype=torch.int32, device=x.device)
    top = x.amax(dim=dim)
    e = torch.frexp(top.float()).exponent.to(torch.int32)
    bad = ~torch.isfinite(x).all(dim=dim)
    return e.masked_fill_(bad, NONFINITE)


def limbs(x: torch.Tensor, dim: int, e: torch.Tensor) -> torch.Tensor:
    """int64 [..., LIMBS]: per slice along ``dim``, the sum of floor(x · 2^(F - e)) as limbs.

    ``e`` is the slice's agreed exponent (``exponents`` all-reduced with MAX),
    shaped like ``x`` with ``dim`` reduced. Limb j holds bits [31 j, 31 j + 31)
    of every value, summed without carries, so the limbs of any split of a
    slice add up to the limbs of the whole.
    """
    shape = list(x.shape)
    del shape[dim]
    out = torch.zeros(shape + [LIMBS], dtype=torch.int64, device=x.device)
    if x.numel() == 0:
        return out
    finite = e < NONFINITE
    shift = torch.where(finite, FRACTION_BITS - e, 0).unsqueeze(dim)
    xs = torch.where(finite.unsqueeze(dim), x.double(), 0.0)
    scaled = torch.ldexp(xs, shift.double())  # exact: a power of two in fp64
    unit = float(1 << LIMB_BITS)
    hi = torch.floor(scaled / unit)  # exact: the division by a power of two, then floor
    lo = torch.floor(scaled - hi * unit)  # exact: the bits below 2^31
    out[..., 1] = hi.to(torch.int64).sum(dim=dim)
    out[..., 0] = lo.to(torch.int64).sum(dim=dim)
    return out


def values(sums: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """fp64: the sums that ``limbs`` (added over ranks) and ``e`` stand for; nan where ``e`` is ``NONFINITE``."""
    total = sums[..., 1].double() * float(1 << LIMB_BITS) + sums[..., 0].double()
    finite = e < NONFINITE
    exp = torch.where(finite, e - FRACTION_BITS, 0)
    out = torch.ldexp(total, exp.double())
    return out.masked_fill_(~finite, float("nan"))
