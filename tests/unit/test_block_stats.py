"""``gefen_titan.optim.block_stats``: the agreement's block-variance sums are exact and order-free.

The agreement all-reduces each rank's sums; for the periods (and so the
state) to be bit-identical at every layout, the sum of the ranks' parts must
not depend on how the blocks are split between ranks nor on the order they
are added in. These tests split the same values many ways and check the
integers and the floats read back are the same, that the integers are the
exact sum of each value's floor on the grid (against Python fractions), and
that the result is within the error bound the module states.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from gefen_titan.optim import block_stats as bs


def _values(n: int, g: int, seed: int) -> torch.Tensor:
    """fp64 values in [0, 2^(2g)) over ~60 binades, a few exactly zero."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.rand(n, generator=gen, dtype=torch.float64) * 60.0
    v = torch.exp2(2 * g - 1 - mag) * torch.rand(n, generator=gen, dtype=torch.float64)
    v[:: max(1, n // 7)] = 0.0
    return v


def _integer(limbs: torch.Tensor) -> int:
    return sum(int(v) << (bs.LIMB_BITS * j) for j, v in enumerate(limbs.tolist()))


def _splits(n: int, rng: random.Random) -> list[list[int]]:
    """A random permutation of range(n) cut into 1-6 parts."""
    order = list(range(n))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, 5)))
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]


@pytest.mark.parametrize("g", [-40, 0, 3, 70])
def test_fixed_point_sum_is_the_same_for_any_split_and_order(g):
    values = _values(5000, g, seed=g + 100)
    whole = bs.fixed_point_limbs(values, g)
    rng = random.Random(g)
    floats = set()
    for _ in range(20):
        parts = _splits(len(values), rng)
        limbs = sum(bs.fixed_point_limbs(values[idx], g) for idx in reversed(parts))
        assert torch.equal(limbs, whole)
        assert bs.limbs_to_sums(limbs.view(1, -1), [g]).item() == bs.limbs_to_sums(whole.view(1, -1), [g]).item()
        # What an fp64 reduction of the same parts would give: it must depend
        # on the split, or these values could not catch an order-dependent sum.
        floats.add(sum(values[idx].sum().item() for idx in parts))
    assert len(floats) > 1


@pytest.mark.parametrize("g", [-40, 0, 3, 70])
def test_fixed_point_sum_is_exact_on_its_grid_and_within_the_stated_bound(g):
    values = _values(3000, g, seed=g)
    limbs = bs.fixed_point_limbs(values, g)
    assert all(0 <= v < len(values) << bs.LIMB_BITS for v in limbs.tolist())
    e = 2 * g - bs.FRACTION_BITS  # one grid step is 2^e
    step = Fraction(2) ** e
    exact = [Fraction(v) for v in values.tolist()]
    assert _integer(limbs) == sum(math.floor(v / step) for v in exact)
    got = Fraction(bs.limbs_to_sums(limbs.view(1, -1), [g]).item())
    true = sum(exact)
    # The module's bound: flooring loses < N grid steps; then one fp64 rounding.
    assert true - len(values) * step < got + abs(got) * Fraction(2) ** -53
    assert got <= true + abs(true) * Fraction(2) ** -53
    assert abs(got - true) <= abs(true) * Fraction(2) ** -52  # these values: below fp64's own precision


def _reference_sums(grad: torch.Tensor, periods: list[int]) -> list[float]:
    """Gefen's measure block by block in fp64, summed with fsum (correctly rounded)."""
    sq = grad.reshape(-1).float().square().double()
    out = []
    for p in periods:
        if p == 1:
            out.append(0.0)
            continue
        blocks = sq.view(-1, p)
        mean = blocks.sum(dim=1) / p
        out.append(math.fsum((blocks.square().sum(dim=1) / p - mean * mean).clamp_min(0).tolist()))
    return out


def test_block_variance_limbs_of_row_shards_add_up_to_the_whole():
    torch.manual_seed(0)
    grad = torch.randn(96, 48) * torch.logspace(-3, 2, 48)  # columns over five decades
    unit, periods = 48, [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    g = bs.grad_exponent(grad)
    assert g == max(bs.grad_exponent(grad[:40]), bs.grad_exponent(grad[40:]))  # MAX over shards
    whole = bs.block_variance_limbs(grad, periods, unit, g)
    for cuts in ([50], [1, 95], [13, 40, 77], list(range(8, 96, 8))):
        bounds = [0, *cuts, 96]
        parts = [bs.block_variance_limbs(grad[a:b], periods, unit, g) for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(sum(reversed(parts)), whole), cuts
    sums = bs.block_variance_sums(grad, periods, unit)
    ref = _reference_sums(grad, periods)
    assert sums[0].item() == 0.0 and all(s > 0 for s in sums[1:].tolist())
    for p, s, r in zip(periods, sums.tolist(), ref):
        # Per-block variances of row/chunk sums may differ from the reference's
        # in their last bits (different summation trees): a 1e-12 band.
        assert s == pytest.approx(r, rel=1e-12, abs=0.0), p


def test_nonfinite_gradients_give_nan_sums():
    grad = torch.randn(4, 8)
    grad[1, 3] = float("inf")
    assert bs.grad_exponent(grad) == bs.NONFINITE
    assert bs.grad_exponent(torch.zeros(4, 8)) == 0
    assert torch.isnan(bs.block_variance_sums(grad, [1, 2, 8], 8)).all()
    assert bs.block_variance_sums(torch.zeros(4, 8), [1, 2, 8], 8).tolist() == [0.0, 0.0, 0.0]


def test_parameters_too_large_for_the_limbs_are_named():
    assert bs.check_numel("w", bs.MAX_NUMEL - 1) is None
    message = bs.check_numel("layers.0.w", bs.MAX_NUMEL)
    assert message is not None and "layers.0.w" in message and 'optimizer.blocking.mode = "per_rank"' in message
