"""The compiled layers of the codebook DP (``codebook_solver`` explains the method).

Each function is gefen-x's numba kernel's arithmetic (``gefen.quantization``'s
exact DP) restricted to the divide-and-conquer windows; ``solve_kernel`` fills
and back-tracks the whole table, ``window_miss_kernel`` counts, per layer,
the ends whose argmin plain divide and conquer would miss (a test measure).
Kept apart from the solver's torch/numpy glue so that each module has one job;
compiled with ``@njit(cache=True)`` and no fastmath, like gefen-x's kernel.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["solve_kernel", "window_miss_kernel"]

# ------------------------------------------------------------------ kernel
_UNIT_ROUNDOFF = 2.0 ** -53
# Near-tie threshold = _TIE_FACTOR * u * (P2 + F), see _layer_tolerance: about
# three times the four rounding errors a missed argmin needs.
_TIE_FACTOR = 64.0


@njit(cache=True, inline="always")
def _candidate(prefix_w, prefix_wx, prefix_wx2, prev_dp, start_idx, end_idx,
               clusters, num_codebooks, force_endpoints):
    # gefen.quantization._get_exact_dp_numba_kernel's expressions, verbatim.
    sum_w = prefix_w[end_idx] - prefix_w[start_idx - 1]
    sum_wx = prefix_wx[end_idx] - prefix_wx[start_idx - 1]
    sum_wx2 = prefix_wx2[end_idx] - prefix_wx2[start_idx - 1]
    if force_endpoints and clusters == 1:
        fixed_center = -1.0
        segment_cost = (
            sum_wx2
            - 2.0 * fixed_center * sum_wx
            + fixed_center * fixed_center * sum_w
        )
    elif force_endpoints and clusters == num_codebooks:
        fixed_center = 1.0
        segment_cost = (
            sum_wx2
            - 2.0 * fixed_center * sum_wx
            + fixed_center * fixed_center * sum_w
        )
    else:
        segment_cost = sum_wx2 - (sum_wx * sum_wx) / sum_w
    return prev_dp[start_idx - 1] + segment_cost


@njit(cache=True)
def _scan(prefix_w, prefix_wx, prefix_wx2, prev_dp, end_idx, lo, hi,
          clusters, num_codebooks, force_endpoints, tau, scratch):
    """Min over starts lo..hi, its smallest argmin, and the near-tie range.

    The first strictly smaller candidate wins, as in gefen-x's kernel.
    ``(tie_lo, tie_hi)`` is the smallest and largest start whose candidate is
    within ``tau`` of the min (both the argmin when ``tau < 0``).
    """
    best_cost = np.inf
    best_start = -1
    for start_idx in range(lo, hi + 1):
        candidate = _candidate(prefix_w, prefix_wx, prefix_wx2, prev_dp,
                               start_idx, end_idx, clusters, num_codebooks,
                               force_endpoints)
        scratch[start_idx] = candidate
        if candidate < best_cost:
            best_cost = candidate
            best_start = start_idx
    tie_lo = best_start
    tie_hi = best_start
    if tau >= 0.0:
        for start_idx in range(lo, best_start):
            if scratch[start_idx] - best_cost <= tau:
                tie_lo = start_idx
                break
        for start_idx in range(hi, best_start, -1):
            if scratch[start_idx] - best_cost <= tau:
                tie_hi = start_idx
                break
    return best_cost, best_start, tie_lo, tie_hi


@njit(cache=True)
def _fill_layer(prefix_w, prefix_wx, prefix_wx2, prev_dp, cur_dp, back_row,
                clusters, num_codebooks, force_endpoints, end_lo, end_hi, tau,
                stack, scratch):
    """dp[end, clusters] for end in end_lo..end_hi by divide and conquer.

    The ends left of ``mid`` search ``[opt_lo, tie_hi(mid)]``, those right of
    it ``[tie_lo(mid), opt_hi]``: the windows keep every start within ``tau``
    of mid's min, not just its argmin (``tau < 0``: the bare recursion).
    """
    stack[0, 0] = end_lo
    stack[0, 1] = end_hi
    stack[0, 2] = clusters  # opt_lo
    stack[0, 3] = end_hi  # opt_hi
    top = 1
    while top > 0:
        top -= 1
        lo = stack[top, 0]
        hi = stack[top, 1]
        opt_lo = stack[top, 2]
        opt_hi = stack[top, 3]
        mid = (lo + hi) // 2
        scan_hi = opt_hi if opt_hi < mid else mid
        best_cost, best_start, tie_lo, tie_hi = _scan(
            prefix_w, prefix_wx, prefix_wx2, prev_dp, mid, opt_lo, scan_hi,
            clusters, num_codebooks, force_endpoints, tau, scratch)
        cur_dp[mid] = best_cost
        back_row[mid] = best_start
        if mid + 1 <= hi:
            stack[top, 0] = mid + 1
            stack[top, 1] = hi
            stack[top, 2] = tie_lo
            stack[top, 3] = opt_hi
            top += 1
        if lo <= mid - 1:
            stack[top, 0] = lo
            stack[top, 1] = mid - 1
            stack[top, 2] = opt_lo
            stack[top, 3] = tie_hi
            top += 1


@njit(cache=True)
def _full_layer(prefix_w, prefix_wx, prefix_wx2, prev_dp, cur_dp, back_row,
                clusters, num_codebooks, force_endpoints, end_lo, end_hi, scratch):
    """gefen-x's own brute-force layer: every end scans every start."""
    for end_idx in range(end_lo, end_hi + 1):
        best_cost, best_start, tie_lo, tie_hi = _scan(
            prefix_w, prefix_wx, prefix_wx2, prev_dp, end_idx, clusters, end_idx,
            clusters, num_codebooks, force_endpoints, -1.0, scratch)
        cur_dp[end_idx] = best_cost
        back_row[end_idx] = best_start


@njit(cache=True)
def _layer_tolerance(prev_dp, p2_total):
    """The near-tie threshold tau of one layer (the exactness certificate).

    Let f_e(s) be the candidate of start s for end e evaluated in exact
    arithmetic on the float data (prefix sums, previous-layer dp); when
    ``prefix_w`` and ``prefix_wx`` are exact (``_sums_are_exact``) and the
    centres sorted, f is Monge, since only -S1^2/S0 survives in the
    quadrangle inequality. Suppose the window of some end e1 misses its rounded
    smallest argmin a'. Following the window bounds up the recursion gives a
    node E whose window holds a' but whose near-tie range does not, and the
    quadrangle inequality on (e1, E) x (a', opt(E)) bounds the rounded gap
    f~_E(a') - f~_E(opt(E)) by four rounding errors of near-optimal candidates,
    so a' would have been in the range. One candidate's rounding is at most
    ~u * (5.02 * P2 + F): the S2 difference, the square, the division, the
    subtraction, each <= u * P2 since S2 <= P2 = prefix_wx2[N] and
    S1^2/S0 <= S2, and the final addition, <= u * F, where
    F = max |dp_prev| + P2 bounds every near-optimal |f| (dp[e, k] <=
    dp[e-1, k-1] + a one-bin cost). tau = 64 * u * (P2 + F) is about three
    times the four errors.
    """
    f_max = 0.0
    for j in range(prev_dp.shape[0]):
        value = abs(prev_dp[j])
        if value < np.inf and value > f_max:
            f_max = value
    return _TIE_FACTOR * _UNIT_ROUNDOFF * (p2_total + f_max + p2_total)


@njit(cache=True)
def solve_kernel(prefix_w, prefix_wx, prefix_wx2, num_codebooks, force_endpoints,
                  certified, bare):
    """Codebook, and the number of layers solved by gefen-x's full scan.

    ``certified``: the exactness certificate applies (see ``_layer_tolerance``);
    otherwise every layer is a full scan, as slow as gefen-x. ``bare``: windows
    without the near-tie ranges (testing only).
    """
    num_points = prefix_w.shape[0] - 1
    p2_total = prefix_wx2[num_points]
    prev_dp = np.full(num_points + 1, np.inf, dtype=np.float64)
    cur_dp = np.full(num_points + 1, np.inf, dtype=np.float64)
    prev_dp[0] = 0.0
    scratch = np.empty(num_points + 1, dtype=np.float64)
    backtrack = np.full((num_codebooks + 1, num_points + 1), -1, dtype=np.int32)
    depth = 4
    while (1 << depth) <= num_points + 1:
        depth += 1
    stack = np.empty((2 * depth + 4, 4), dtype=np.int64)
    full_scans = 0

    for clusters in range(1, num_codebooks + 1):
        cur_dp[:] = np.inf
        if clusters == num_codebooks:
            # Only dp[N, K] is read: one full scan, as in the original.
            best_cost, best_start, tie_lo, tie_hi = _scan(
                prefix_w, prefix_wx, prefix_wx2, prev_dp, num_points, clusters,
                num_points, clusters, num_codebooks, force_endpoints, -1.0,
                scratch)
            cur_dp[num_points] = best_cost
            backtrack[clusters, num_points] = best_start
        else:
            # Ends past N - (K - k) leave too few bins for the later clusters,
            # so no path to dp[N, K] goes through them.
            end_hi = num_points - (num_codebooks - clusters)
            if certified:
                tau = -1.0 if bare else _layer_tolerance(prev_dp, p2_total)
                _fill_layer(prefix_w, prefix_wx, prefix_wx2, prev_dp, cur_dp,
                            backtrack[clusters], clusters, num_codebooks,
                            force_endpoints, clusters, end_hi, tau, stack,
                            scratch)
            else:
                full_scans += 1
                _full_layer(prefix_w, prefix_wx, prefix_wx2, prev_dp, cur_dp,
                            backtrack[clusters], clusters, num_codebooks,
                            force_endpoints, clusters, end_hi, scratch)
        tmp = prev_dp
        prev_dp = cur_dp
        cur_dp = tmp

    codebook = np.empty(num_codebooks, dtype=np.float32)
    end_idx = num_points
    for cluster_idx in range(num_codebooks, 0, -1):
        start_idx = backtrack[cluster_idx, end_idx]
        if force_endpoints and cluster_idx == 1:
            codebook[cluster_idx - 1] = -1.0
        elif force_endpoints and cluster_idx == num_codebooks:
            codebook[cluster_idx - 1] = 1.0
        else:
            sum_w = prefix_w[end_idx] - prefix_w[start_idx - 1]
            sum_wx = prefix_wx[end_idx] - prefix_wx[start_idx - 1]
            codebook[cluster_idx - 1] = sum_wx / sum_w
        end_idx = start_idx - 1
    return codebook, full_scans


@njit(cache=True)
def window_miss_kernel(prefix_w, prefix_wx, prefix_wx2, num_codebooks, force_endpoints):
    """Per layer: ends the bare and the guarded windows get wrong.

    Each layer is filled by gefen-x's full scan and by divide and conquer with
    and without the near-tie ranges, all from the same full-scan previous
    layer (so the full-scan chain is gefen-x's computation); an end is a miss
    when its dp value or back-pointer differ. O(K * N^2): a test tool.
    """
    num_points = prefix_w.shape[0] - 1
    p2_total = prefix_wx2[num_points]
    prev_dp = np.full(num_points + 1, np.inf, dtype=np.float64)
    prev_dp[0] = 0.0
    scratch = np.empty(num_points + 1, dtype=np.float64)
    dc_dp = np.full(num_points + 1, np.inf, dtype=np.float64)
    dc_back = np.full(num_points + 1, -1, dtype=np.int32)
    full_dp = np.full(num_points + 1, np.inf, dtype=np.float64)
    full_back = np.full(num_points + 1, -1, dtype=np.int32)
    misses = np.zeros((2, num_codebooks + 1), dtype=np.int64)
    depth = 4
    while (1 << depth) <= num_points + 1:
        depth += 1
    stack = np.empty((2 * depth + 4, 4), dtype=np.int64)
    for clusters in range(1, num_codebooks):
        end_hi = num_points - (num_codebooks - clusters)
        full_dp[:] = np.inf
        _full_layer(prefix_w, prefix_wx, prefix_wx2, prev_dp, full_dp, full_back,
                    clusters, num_codebooks, force_endpoints, clusters, end_hi,
                    scratch)
        for guarded in range(2):
            tau = _layer_tolerance(prev_dp, p2_total) if guarded else -1.0
            dc_dp[:] = np.inf
            _fill_layer(prefix_w, prefix_wx, prefix_wx2, prev_dp, dc_dp, dc_back,
                        clusters, num_codebooks, force_endpoints, clusters,
                        end_hi, tau, stack, scratch)
            for end_idx in range(clusters, end_hi + 1):
                if (full_dp[end_idx] != dc_dp[end_idx]
                        or full_back[end_idx] != dc_back[end_idx]):
                    misses[guarded, clusters] += 1
        tmp = prev_dp
        prev_dp = full_dp
        full_dp = tmp
    return misses


# ------------------------------------------------------------------ API
