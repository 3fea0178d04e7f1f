"""Learn a merged Gefen codebook from source codebooks weighted by their use.

When one target shard gathers momentum quantized with several source ranks'
codebooks, it needs one codebook of its own (Gefen keeps one per optimizer).
With target blocks equal to source blocks the normalized values to encode are
exactly the source codewords, so a weighted 1-D k-means over at most
N x 256 (codeword, use count) points is what Gefen's own codebook learning
(a k-means on a histogram of normalized gradients) would converge to, at a
few milliseconds instead of seconds of numba.

Gefen requires the result sorted, fp32 [256], with endpoints exactly -1 and
+1 (its load validation and the nearest-codeword search rely on it).
"""

from __future__ import annotations

import torch

__all__ = ["merge_codebooks", "K"]

K = 256


def merge_codebooks(codebooks: list[torch.Tensor], weights: list[torch.Tensor], iters: int = 50) -> torch.Tensor:
    """Weighted Lloyd iterations over the source codewords, endpoints pinned.

    ``codebooks[i]`` is source i's [256] codebook and ``weights[i]`` how many
    target elements use each of its codewords. Each source codebook is
    already a good 256-level quantizer of the same distribution, so Lloyd
    starts from each in turn (quantile starts collapse onto the dense centre)
    and the lowest-distortion result wins.
    """
    points = torch.cat([c.double().reshape(-1) for c in codebooks])
    w_all = torch.cat([w.double().reshape(-1) for w in weights])
    keep = w_all > 0
    distinct, inverse = torch.unique(points[keep], return_inverse=True)
    w = torch.zeros_like(distinct).index_add_(0, inverse, w_all[keep])
    inner = distinct[(distinct > -1) & (distinct < 1)]
    if inner.numel() <= K - 2:
        # Few enough values to keep every one exactly; pad by repeating the
        # last inner value, as gefen-x pads a codebook learned from few bins.
        body = inner if inner.numel() else torch.zeros(1, dtype=torch.float64)
        pad = body[-1:].expand(K - 2 - body.numel())
        cb = torch.cat([body.new_tensor([-1.0]), body, pad, body.new_tensor([1.0])])
        return cb.float()
    best, best_cost = None, None
    for start in codebooks:
        centers, cost = _lloyd(distinct, w, start.double().reshape(-1).clone(), iters)
        if best_cost is None or cost < best_cost:
            best, best_cost = centers, cost
    return best.float()


def _assign(points: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """Nearest center, ties to the lower index (Gefen's rule)."""
    idx = torch.searchsorted(centers, points).clamp_(1, K - 1)
    left, right = centers[idx - 1], centers[idx]
    return torch.where((points - left).abs() <= (points - right).abs(), idx - 1, idx)


def _lloyd(points: torch.Tensor, w: torch.Tensor, centers: torch.Tensor, iters: int) -> tuple[torch.Tensor, float]:
    centers[0], centers[-1] = -1.0, 1.0
    for _ in range(iters):
        centers = torch.sort(centers).values
        assign = _assign(points, centers)
        mass = torch.zeros(K, dtype=torch.float64).index_add_(0, assign, w)
        total = torch.zeros(K, dtype=torch.float64).index_add_(0, assign, w * points)
        new = torch.where(mass > 0, total / mass.clamp_min(1e-300), centers)
        new[0], new[-1] = -1.0, 1.0
        if torch.equal(new, centers):
            break
        centers = new
    centers = torch.sort(centers).values
    cost = float((w * (points - centers[_assign(points, centers)]) ** 2).sum())
    return centers, cost
