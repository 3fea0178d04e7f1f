"""A fast solver for gefen-x's exact codebook DP that gives the same bits.

Why: gefen-x learns its 256-entry codebook with
``gefen.quantization.exact_dp(stats, num_codebooks=256, force_endpoints=True)``,
an optimal weighted 1-D k-means over the active bins of a 4096-bin histogram of
block-normalized gradients. Its numba kernel fills the whole DP table by brute
force: for every layer ``k`` (clusters) and every end bin it scans every start
bin, O(K * N^2) segment costs, 3-15 s single-threaded for N = 4096 active bins,
paid at every codebook refresh. :func:`solve_codebook` computes the same
codebook in O(K * N log N) (about 0.1 s for N = 4096 once compiled) and returns
a bit-identical float32 tensor.

How: 1-D k-means segment costs satisfy the quadrangle (Monge) inequality, so in
exact arithmetic the smallest optimal start ``opt(end)`` of each DP layer is
non-decreasing in ``end``. Each layer is then filled by divide and conquer:
``opt(mid)`` is found by scanning starts in ``[opt_lo, opt_hi]`` only, and the
ends left of ``mid`` are searched in ``[opt_lo, opt(mid)]``, those right of it
in ``[opt(mid), opt_hi]`` (an explicit stack, no recursion); every end still
gets its dp value (the next layer reads them all). Each candidate is evaluated
with gefen-x's own arithmetic, so whenever gefen-x's argmin lies in the
searched window the dp value and the back-pointer are exactly gefen-x's:

* the same float64 prefix sums, built the same way with torch;
* the same segment cost expressions: ``sum_wx2 - 2c*sum_wx + c*c*sum_w`` for the
  clusters pinned at ``c = -1`` (first) and ``c = +1`` (last) when
  ``force_endpoints``, ``sum_wx2 - (sum_wx*sum_wx)/sum_w`` for free ones;
* the same ``candidate = dp[start-1, k-1] + cost`` and the same tie rule: starts
  are scanned in increasing order and only a strictly smaller candidate
  replaces the best, so the smallest argmin wins, as in the numba kernel (with
  that rule divide and conquer returns the smallest argmin for Monge costs);
* the same start ranges (from ``k``, so no ``inf`` state is ever a candidate
  except in layer 1, where only ``start = 1`` is finite, as in the original);
* the same back-tracking, centres ``sum_wx/sum_w`` rounded to float32, and the
  final sort; ``num_codebooks > N`` takes the same padded path as
  ``gefen.quantization._build_padded_codebook``.

Compiled with numba ``@njit(cache=True)`` without fastmath, like gefen-x's
kernel, so no reassociation or FMA contraction changes a rounding.

Two exact shortcuts: layer ``k`` only fills ends ``k .. N-(K-k)`` (an end
past that leaves too few bins for the remaining clusters, so no path through
it reaches the final state, whose value alone is read), and the last layer,
whose only read entry is ``end = N``, is a full scan, as in the original.

Floating-point near-ties: monotonicity holds for the exact costs, while the DP
compares rounded float64 values. Where two starts are within rounding of each
other, the rounded argmin of one end can lie outside the window that plain
divide and conquer derived from a neighbour -- this does happen (in the tests'
histograms with count-1 bins among ~2^26 ones a few layers in a hundred have
such a miss, though none changed a final codebook in ~10 000 random trials). So
the windows here are widened: a child's window is bounded not by ``opt(mid)``
but by the smallest / largest start whose candidate is within ``tau`` of
mid's min, with ``tau`` about three times a bound on four candidates'
rounding errors (``codebook_dp._layer_tolerance`` gives the argument: a missed argmin
would have to be such a near-tie at some ancestor). This costs 5-50 % more
CPU time than the plain recursion (0.08-0.11 s for the benchmark's 4096-bin
histograms) and makes every layer gefen-x's layer provided

* the sums of w and w*x are exact (then the exact-arithmetic candidates on the
  float data are Monge): checked at run time by ``_sums_are_exact``; it holds
  for gefen's histograms (integer counts, centres on a 2^-12 grid) up to a
  total count of 2^41 (2.2e12 elements per refresh), and the centres are
  sorted. Otherwise every layer falls back to gefen-x's full scan (exact, as
  slow as gefen-x);
* the rounding-error bound is right, a hand derivation (with a factor-3
  margin), not a machine-checked proof.

What the tests check (``tests/unit/test_codebook_solver.py``): bit-identity (integer
view of the float32 codebook) with ``gefen.quantization.exact_dp`` on
histograms of real gradients of small models block-normalized the way
gefen's learner does (one through the learner itself), on synthetic Gaussian,
Laplace, Cauchy, spiky/sparse, exactly-256/257-active-bin, fewer-than-256
(padded), huge-count (> 2^24) and tied/symmetric histograms, other K and
``force_endpoints=False``, the full-scan fallback; and, layer by layer with
:func:`dp_window_misses`, that the widened windows never miss gefen-x's argmin
where the plain ones do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from gefen_titan.optim import codebook_dp

__all__ = [
    "solve_codebook",
    "codebook_from_counts",
    "histogram_counts",
    "histogram_stats",
    "solve_codebook_full_scans",
    "dp_window_misses",
]


def _build_padded_codebook(active_centers: torch.Tensor, num_codebooks: int,
                           force_endpoints: bool) -> torch.Tensor:
    # Same as gefen.quantization._build_padded_codebook.
    codebook = torch.empty(num_codebooks, dtype=torch.float32)
    num_active_centers = int(active_centers.numel())
    codebook[:num_active_centers] = active_centers
    codebook[num_active_centers:] = active_centers[-1]
    if force_endpoints:
        codebook[0] = -1.0
        codebook[-1] = 1.0
    codebook, _ = codebook.sort()
    return codebook


def _sums_are_exact(terms: np.ndarray) -> bool:
    """True when every sum of any subset of ``terms`` is exact in float64.

    That holds when all terms are multiples of 2^-q and sum(|t|) < 2^(53-q):
    every partial sum (in any order) and every difference of two prefix sums
    is then a multiple of 2^-q below 2^(53-q) in magnitude, so representable.
    """
    t = np.abs(terms[terms != 0.0])
    if t.size == 0:
        return True
    if not np.all(np.isfinite(t)):
        return False
    mantissa, exponent = np.frexp(t)  # t = mantissa * 2^exponent, 0.5 <= mantissa < 1
    m = (mantissa * 2.0 ** 53).astype(np.int64)  # exact: a 53-bit integer
    lowest_bit = np.frexp((m & -m).astype(np.float64))[1] - 1  # log2 of m's lowest set bit
    q = max(0, int(-(exponent - 53 + lowest_bit).min()))
    return math.fsum(t.tolist()) < 2.0 ** (53 - q)


def _prefix_sums(active_centers: torch.Tensor, active_counts: torch.Tensor):
    """gefen-x's float64 prefix sums (same construction as ``exact_dp``).

    Also returns whether the exactness certificate applies: centres sorted and
    the sums of w and w*x exact (``_sums_are_exact``). For gefen's histograms
    it does: integer counts, centres on a 2^-12 grid, total count below 2^41.
    """
    num_points = active_centers.numel()
    prefix_w = torch.zeros(num_points + 1, dtype=torch.float64)
    prefix_wx = torch.zeros(num_points + 1, dtype=torch.float64)
    prefix_wx2 = torch.zeros(num_points + 1, dtype=torch.float64)
    weights64 = active_counts.to(torch.float64)
    centers64 = active_centers.to(torch.float64)
    prefix_w[1:] = torch.cumsum(weights64, dim=0)
    prefix_wx[1:] = torch.cumsum(weights64 * centers64, dim=0)
    prefix_wx2[1:] = torch.cumsum(weights64 * centers64.square(), dim=0)
    # float32 * float32 is exact in float64, so these terms are the exact w*x.
    certified = bool(
        bool(torch.all(centers64[1:] >= centers64[:-1]))
        and _sums_are_exact(weights64.numpy())
        and _sums_are_exact((weights64 * centers64).numpy())
        and math.isfinite(float(prefix_wx2[-1]))
    )
    return prefix_w, prefix_wx, prefix_wx2, certified


def _validated(active_centers, active_counts, num_codebooks):
    # The checks and conversions of gefen.quantization.exact_dp (plus shape and
    # num_codebooks checks, which exact_dp leaves to later failures).
    active_centers = active_centers.detach().cpu().to(torch.float32)
    active_counts = active_counts.detach().cpu().to(torch.float32)
    if active_centers.dim() != 1 or active_counts.shape != active_centers.shape:
        raise ValueError(
            "Expected 1-D active_centers and active_counts of the same length, got "
            f"{tuple(active_centers.shape)} and {tuple(active_counts.shape)}."
        )
    if active_centers.numel() == 0:
        raise ValueError("Cannot run exact DP on an empty histogram.")
    if not torch.all(active_counts > 0):
        raise ValueError(
            "exact DP expects strictly positive counts for all active histogram bins."
        )
    if int(num_codebooks) < 1:
        raise ValueError(f"num_codebooks must be >= 1, got {num_codebooks}.")
    return active_centers, active_counts, int(num_codebooks)


def _solve(active_centers, active_counts, num_codebooks, force_endpoints, bare=False):
    """(codebook, layers solved by full scan): ``solve_codebook`` plus a count.

    ``bare=True`` drops the near-tie ranges (plain divide and conquer; tests).
    """
    active_centers, active_counts, num_codebooks = _validated(
        active_centers, active_counts, num_codebooks)
    if num_codebooks > active_centers.numel():
        return _build_padded_codebook(active_centers, num_codebooks, force_endpoints), 0
    prefix_w, prefix_wx, prefix_wx2, certified = _prefix_sums(active_centers, active_counts)
    codebook_np, full_scans = codebook_dp.solve_kernel(prefix_w.numpy(), prefix_wx.numpy(),
                                            prefix_wx2.numpy(), num_codebooks,
                                            bool(force_endpoints), certified, bare)
    codebook, _ = torch.from_numpy(codebook_np).sort()
    return codebook, int(full_scans)


def solve_codebook(
    active_centers: torch.Tensor,
    active_counts: torch.Tensor,
    num_codebooks: int = 256,
    force_endpoints: bool = True,
) -> torch.Tensor:
    """gefen-x's exact-DP codebook, bit for bit, in O(K * N log N).

    Drop-in for ``gefen.quantization.exact_dp({"active_centers": c,
    "active_counts": w}, num_codebooks, force_endpoints)``: the same float32 CPU
    tensor of ``num_codebooks`` sorted centres, the same padded codebook when
    ``num_codebooks`` exceeds the number of active bins, and the same
    ``ValueError`` for an empty histogram or a non-positive count (and for
    ``num_codebooks < 1``, where ``exact_dp`` returns an empty tensor or fails).
    """
    return _solve(active_centers, active_counts, num_codebooks, force_endpoints)[0]


def dp_window_misses(
    active_centers: torch.Tensor,
    active_counts: torch.Tensor,
    num_codebooks: int = 256,
    force_endpoints: bool = True,
) -> np.ndarray:
    """Per DP layer, the ends divide and conquer gets wrong: int64 [2, K + 1].

    Diagnostic for the exactness argument (O(K * N^2), as slow as gefen-x):
    each layer ``k`` is solved by gefen-x's full scan and by divide and conquer
    from the same full-scan previous layer; ``[0, k]`` counts the ends whose dp
    value or back-pointer differ with the bare windows, ``[1, k]`` with the
    near-tie ranges that :func:`solve_codebook` uses (always 0 if the
    certificate is right). The last layer is a full scan in both (0).
    """
    active_centers, active_counts, num_codebooks = _validated(
        active_centers, active_counts, num_codebooks)
    if num_codebooks > active_centers.numel():
        return np.zeros((2, num_codebooks + 1), dtype=np.int64)
    prefix_w, prefix_wx, prefix_wx2, _ = _prefix_sums(active_centers, active_counts)
    return codebook_dp.window_miss_kernel(prefix_w.numpy(), prefix_wx.numpy(),
                               prefix_wx2.numpy(), num_codebooks,
                               bool(force_endpoints))


def histogram_stats(bin_counts: torch.Tensor) -> dict:
    """gefen's ``histogram_stats`` for int64 bin counts over [-1, 1].

    Built as ``gefen.gefen.learn_gefen_exact_codebook_from_grad_periods`` does:
    float32 ``linspace`` edges, centres ``0.5 * (e[:-1] + e[1:])``, counts cast to
    float32 once, active bins = counts > 0.
    """
    if bin_counts.dim() != 1:
        raise ValueError(f"Expected 1-D bin counts, got shape {tuple(bin_counts.shape)}.")
    histogram_bins = bin_counts.numel()
    bin_edges = torch.linspace(-1.0, 1.0, steps=histogram_bins + 1, dtype=torch.float32)
    bin_centers = 0.5 * (bin_edges[:-1] + bin_edges[1:])
    counts = bin_counts.detach().cpu().to(torch.float32)
    active = counts > 0
    return {
        "bin_edges": bin_edges,
        "bin_centers": bin_centers,
        "bin_counts": counts,
        "active_bins": active,
        "active_centers": bin_centers[active],
        "active_counts": counts[active],
        "active_sums": bin_centers[active] * counts[active],
    }


def codebook_from_counts(bin_counts: torch.Tensor, num_codebooks: int = 256) -> torch.Tensor:
    """gefen's learned codebook (``force_endpoints=True``) from int64 bin counts.

    ``bin_counts`` is the ``num_codebooks * 16``-bin histogram (4096 bins for
    256 entries) that ``learn_gefen_exact_codebook_from_grad_periods``
    accumulates; the result equals that function's codebook (on CPU).
    """
    stats = histogram_stats(bin_counts)
    return solve_codebook(stats["active_centers"], stats["active_counts"],
                          num_codebooks=num_codebooks, force_endpoints=True)


def histogram_counts(
    grad_periods: Iterable[tuple[torch.Tensor, int]],
    num_bins: int = 4096,
) -> torch.Tensor:
    """int64 bin counts of block-normalized tensors, as gefen's learner builds them.

    ``grad_periods`` yields ``(tensor, period)``; each tensor is flattened, cut
    into blocks of ``period`` elements, divided by the block's absmax (all-zero
    blocks stay 0) and binned with ``floor((x + 1) / (2 / num_bins))`` clamped
    to the range -- the non-fused CPU path of
    ``learn_gefen_exact_codebook_from_grad_periods``.
    """
    bin_width = 2.0 / float(num_bins)
    counts = torch.zeros(num_bins, dtype=torch.int64)
    for tensor, period in grad_periods:
        blocks = tensor.detach().reshape(-1).float().cpu().view(-1, int(period))
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        normalized = torch.where(absmax > 0, blocks / absmax, torch.zeros_like(blocks))
        idx = torch.floor((normalized.reshape(-1) + 1.0) / bin_width).to(torch.long)
        counts.add_(torch.bincount(idx.clamp(0, num_bins - 1), minlength=num_bins))
    return counts


def solve_codebook_full_scans(
    active_centers: torch.Tensor,
    active_counts: torch.Tensor,
    num_codebooks: int = 256,
    force_endpoints: bool = True,
) -> tuple[torch.Tensor, int]:
    """:func:`solve_codebook` and the number of DP layers it solved by full scan.

    A diagnostic, like :func:`dp_window_misses`: a layer goes to a full scan
    when the near-tie guard cannot certify divide and conquer, so the count
    says how often the fast path was given up (``benchmarks/codebook_solver.py``
    reports it per histogram).
    """
    return _solve(active_centers, active_counts, num_codebooks, force_endpoints)
