"""``gefen_titan.optim.codebook_solver`` gives gefen-x's exact-DP codebook, bit for bit.

Every case compares ``solve_codebook`` (or ``codebook_from_counts``) with
``gefen.quantization.exact_dp`` on the integer view of the float32 codebooks:
histograms of real gradients of small models block-normalized at several
periods (one of them through gefen's own learner, end to end), synthetic
Gaussian / Laplace / heavy-tailed / spiky / exactly-K / padded / huge-count
histograms, random and symmetric ties, other K and ``force_endpoints=False``.
``dp_window_misses`` checks the exactness certificate layer by layer: the
near-tie windows never miss gefen-x's argmin, also where bare divide and
conquer does. gefen-x's brute-force DP costs ~4-10 s per 4096-bin histogram on
one core, so only three cases are full size; the rest use fewer bins.
"""

from __future__ import annotations

import gefen.gefen as gefen_impl
import pytest
import torch
import torch.nn as nn
from gefen import quantization

from benchmarks import codebook_solver as bench_cs
from gefen_titan.optim import codebook_solver as cs

BINS = 4096
EDGES = torch.linspace(-1.0, 1.0, BINS + 1, dtype=torch.float32)
CENTERS = 0.5 * (EDGES[:-1] + EDGES[1:])


# --------------------------------------------------------------- helpers
def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype == torch.float32
    assert ours.shape == ref.shape and ours.device == ref.device
    assert torch.equal(ours, ref)
    diff = ours.view(torch.int32) != ref.view(torch.int32)
    assert not diff.any(), f"{int(diff.sum())} entries differ, first at {int(diff.nonzero()[0])}"


def check_stats(centers, counts, num_codebooks=256, force_endpoints=True):
    ref = quantization.exact_dp({"active_centers": centers, "active_counts": counts},
                                num_codebooks, force_endpoints)
    ours = cs.solve_codebook(centers, counts, num_codebooks, force_endpoints)
    assert_same_bits(ours, ref)
    return ours


def check_counts(bin_counts: torch.Tensor, num_codebooks=256):
    """codebook_from_counts vs exact_dp on the learner's histogram stats."""
    ref = quantization.exact_dp(cs.histogram_stats(bin_counts), num_codebooks, True)
    assert_same_bits(cs.codebook_from_counts(bin_counts, num_codebooks), ref)


def subset(idx, weights):
    """Active centres at bin indices ``idx`` (sorted) with float32 ``weights``."""
    idx = torch.as_tensor(idx).sort().values
    return CENTERS[idx], torch.as_tensor(weights, dtype=torch.float32)


def normalized_counts(samples: torch.Tensor, period: int) -> torch.Tensor:
    return cs.histogram_counts([(samples, period)])


def grads_of(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def tiny_mlp_grads(seed: int, dim: int = 16, hidden: int = 32):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
    return grads_of(model, model(torch.randn(8, dim)).square().mean())


def embedding_grads(seed: int):
    torch.manual_seed(seed)
    emb, head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
    model = nn.ModuleList([emb, head])
    tokens = torch.randint(0, 64, (4, 12))
    logits = head(emb(tokens))
    loss = nn.functional.cross_entropy(logits.reshape(-1, 64), torch.randint(0, 64, (48,)))
    return grads_of(model, loss)


def conv_grads(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    return grads_of(model, model(torch.randn(2, 3, 12, 12)).abs().mean())


def with_period(grads, period):
    """(grad, period) pairs; ``period`` None = row length, non-divisors -> whole tensor."""
    out = []
    for g in grads:
        p = g.shape[-1] if period is None else period
        out.append((g, p if g.numel() % p == 0 else g.numel()))
    return out


# --------------------------------------------------------------- full size
def test_end_to_end_through_gefen_learner(monkeypatch):
    """gefen's learner (its histogram and its exact_dp) == codebook_from_counts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    model(torch.randn(32, 64)).square().mean().backward()
    periods = [32, 64, 128, 64]
    grad_periods = [(name, p.grad, period, None)
                    for (name, p), period in zip(model.named_parameters(), periods)]
    seen = {}
    real_exact_dp = quantization.exact_dp

    def spy(histogram_stats, num_codebooks, force_endpoints=True):
        seen["stats"] = histogram_stats
        return real_exact_dp(histogram_stats, num_codebooks, force_endpoints)

    monkeypatch.setattr(quantization, "exact_dp", spy)
    ref = gefen_impl.learn_gefen_exact_codebook_from_grad_periods(
        grad_periods=grad_periods, codebook_device=torch.device("cpu"),
        num_codebooks=256, force_endpoints=True, verbose=False,
        compute_mse_logging=False, use_fused_histogram=False)
    counts = cs.histogram_counts([(g, period) for _, g, period, _ in grad_periods])
    ours_stats = cs.histogram_stats(counts)
    for key, value in seen["stats"].items():
        assert torch.equal(ours_stats[key], value), key
    assert int(ours_stats["active_centers"].numel()) > 3000
    assert_same_bits(cs.codebook_from_counts(counts), ref)


def test_full_size_gaussian():
    g = torch.Generator().manual_seed(1)
    counts = normalized_counts(torch.randn(1 << 21, generator=g), 256)
    assert int((counts > 0).sum()) == BINS
    check_counts(counts)


def test_full_size_huge_counts():
    """Counts above 2^24 (float32 rounds them; the DP sees the rounded values)."""
    g = torch.Generator().manual_seed(2)
    base = normalized_counts(_samples("laplace", 1 << 18, g), 64)
    counts = base * (1 << 22) + torch.randint(0, 1 << 20, (BINS,), generator=g)
    counts[torch.randperm(BINS, generator=g)[:200]] = 1  # tiny bins among huge ones
    assert counts.max() > 2**24 and (counts > 0).all()
    assert not torch.equal(counts.float().long(), counts)  # some counts are rounded
    assert counts.sum() < 2**41  # so the certificate applies: divide and conquer
    stats = cs.histogram_stats(counts)
    assert cs._prefix_sums(stats["active_centers"], stats["active_counts"])[3]
    check_counts(counts)


# --------------------------------------------------------------- real gradients, fewer bins
@pytest.mark.parametrize("source", ["mlp", "embedding", "conv"])
@pytest.mark.parametrize("period", [8, 32, None])
def test_real_gradient_histograms(source, period):
    grads = {"mlp": tiny_mlp_grads, "embedding": embedding_grads, "conv": conv_grads}[source](3)
    counts = cs.histogram_counts(with_period(grads, period))
    assert int((counts > 0).sum()) < 2000
    check_counts(counts)


def test_period_one_is_padded():
    """period 1 normalizes every element to -1, 0 or 1: three bins, padded path."""
    counts = cs.histogram_counts(with_period(tiny_mlp_grads(4), 1))
    assert int((counts > 0).sum()) <= 3
    check_counts(counts)


# --------------------------------------------------------------- synthetic
def _samples(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "gaussian":
        return torch.randn(n, generator=g)
    if kind == "laplace":
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        return sign * torch.empty(n).exponential_(generator=g)
    if kind == "cauchy":
        return torch.empty(n).cauchy_(generator=g)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind,period", [("gaussian", 64), ("laplace", 16), ("cauchy", 128)])
def test_synthetic_distributions(kind, period):
    g = torch.Generator().manual_seed({"gaussian": 1, "laplace": 2, "cauchy": 3}[kind])
    counts = normalized_counts(_samples(kind, 3072, g), period)
    assert 300 < int((counts > 0).sum()) < 2000
    check_counts(counts)


def test_spiky_many_empty_bins():
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(BINS, dtype=torch.int64)
    spikes = torch.randperm(BINS, generator=g)[:40]
    counts[spikes] = torch.randint(10_000, 1_000_000, (40,), generator=g)
    background = torch.randperm(BINS, generator=g)[:600]
    counts[background] += torch.randint(1, 5, (600,), generator=g)
    counts[0] += 7
    counts[-1] += 7
    check_counts(counts)


@pytest.mark.parametrize("n_active", [256, 257])
def test_exactly_k_or_k_plus_one_active_bins(n_active):
    g = torch.Generator().manual_seed(n_active)
    counts = torch.zeros(BINS, dtype=torch.int64)
    counts[torch.randperm(BINS, generator=g)[:n_active]] = torch.randint(
        1, 1000, (n_active,), generator=g)
    check_counts(counts)
    stats = cs.histogram_stats(counts)
    check_stats(stats["active_centers"], stats["active_counts"], 256, force_endpoints=False)


@pytest.mark.parametrize("n_active", [1, 2, 100, 255])
@pytest.mark.parametrize("force_endpoints", [True, False])
def test_fewer_active_bins_than_entries_is_padded(n_active, force_endpoints):
    g = torch.Generator().manual_seed(n_active)
    centers, weights = subset(torch.randperm(BINS, generator=g)[:n_active],
                              torch.randint(1, 50, (n_active,), generator=g))
    check_stats(centers, weights, 256, force_endpoints)


@pytest.mark.parametrize("seed", range(4))
def test_huge_counts_small(seed):
    g = torch.Generator().manual_seed(seed)
    n = 700
    idx = torch.randperm(BINS, generator=g)[:n]
    weights = torch.randint(1 << 24, 1 << 31, (n,), generator=g)
    weights[torch.rand(n, generator=g) < 0.4] = 1
    centers, weights = subset(idx, weights.float())
    check_stats(centers, weights)
    assert cs._solve(centers, weights, 256, True)[1] == 0  # certified: divide and conquer


@pytest.mark.parametrize("seed", range(4))
def test_random_ties(seed):
    """Counts from a tiny set (many exactly tied candidates), and symmetric histograms."""
    g = torch.Generator().manual_seed(100 + seed)
    n = 600
    idx = torch.randperm(BINS, generator=g)[:n]
    check_stats(*subset(idx, torch.randint(1, 4, (n,), generator=g).float()))
    check_stats(*subset(idx, torch.ones(n)))
    half = torch.randint(1, 5, (n // 2,), generator=g).float()
    mirror = torch.cat([torch.arange(BINS // 2 - n // 2, BINS // 2),
                        torch.arange(BINS // 2, BINS // 2 + n // 2)])
    check_stats(*subset(mirror, torch.cat([half, half.flip(0)])))


@pytest.mark.parametrize("num_codebooks", [1, 2, 3, 16, 100])
@pytest.mark.parametrize("force_endpoints", [True, False])
def test_other_sizes(num_codebooks, force_endpoints):
    g = torch.Generator().manual_seed(num_codebooks)
    n = 500
    idx = torch.randperm(BINS, generator=g)[:n]
    check_stats(*subset(idx, torch.randint(1, 10_000, (n,), generator=g).float()),
                num_codebooks, force_endpoints)


def test_off_grid_and_unsorted_centers_fall_back_to_full_scans():
    """No certificate (centres off the grid or unsorted, or a total count so large
    that the sums of w*x round): every layer is a full scan, still gefen-x's result."""
    g = torch.Generator().manual_seed(9)
    n, k = 300, 32
    centers = (torch.rand(n, generator=g) * 2 - 1).sort().values
    weights = torch.rand(n, generator=g) * 100 + 0.5
    check_stats(centers, weights, k)
    assert cs._solve(centers, weights, k, True)[1] == k - 1
    shuffled = torch.randperm(n, generator=g)
    grid_centers, grid_weights = subset(torch.randperm(BINS, generator=g)[:n],
                                        torch.randint(1, 100, (n,), generator=g))
    check_stats(grid_centers[shuffled], grid_weights, k)
    assert cs._solve(grid_centers[shuffled], grid_weights, k, True)[1] == k - 1
    assert cs._solve(grid_centers, grid_weights, k, True)[1] == 0
    too_big = grid_weights.clone()  # total count >= 2^41: sums of w*x may round
    too_big[::3] = 2.0**40
    check_stats(grid_centers, too_big, k)
    assert cs._solve(grid_centers, too_big, k, True)[1] == k - 1


# --------------------------------------------------------------- the certificate, layer by layer
def test_near_tie_windows_never_miss():
    """Bare divide and conquer does miss gefen-x's argmin on some layers of these
    histograms (near-ties at rounding level: count-1 bins among ~2^26 ones); the
    near-tie windows never do, and both final codebooks are gefen-x's."""
    g = torch.Generator().manual_seed(11)
    bare_misses = 0
    for trial in range(6):
        n, k = 450, [40, 96, 160, 200, 64, 128][trial]
        idx = torch.randperm(BINS, generator=g)[:n]
        weights = torch.where(torch.rand(n, generator=g) < 0.5, 1.0, float(2**26))
        centers, weights = subset(idx, weights)
        misses = cs.dp_window_misses(centers, weights, k, trial % 2 == 0)
        assert misses[1].sum() == 0
        bare_misses += int(misses[0].sum())
        ref = check_stats(centers, weights, k, trial % 2 == 0)
        assert_same_bits(cs._solve(centers, weights, k, trial % 2 == 0, bare=True)[0], ref)
    assert bare_misses > 0  # the check above is not vacuous


# --------------------------------------------------------------- contract
def test_does_not_call_gefen_dp(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("gefen's DP was called")

    counts = cs.histogram_counts(with_period(embedding_grads(0), 16))
    stats = cs.histogram_stats(counts)
    ref = quantization.exact_dp(stats, 256, True)
    monkeypatch.setattr(quantization, "_get_exact_dp_numba_kernel", boom)
    monkeypatch.setattr(quantization, "_run_exact_dp_python", boom)
    monkeypatch.setattr(quantization, "exact_dp", boom)
    assert_same_bits(cs.codebook_from_counts(counts), ref)
    assert_same_bits(cs.solve_codebook(stats["active_centers"], stats["active_counts"]), ref)


@pytest.mark.parametrize("centers,counts,match", [
    (torch.zeros(0), torch.zeros(0), "empty histogram"),
    (CENTERS[:3], torch.tensor([1.0, 0.0, 2.0]), "strictly positive"),
    (CENTERS[:3], torch.tensor([1.0, -3.0, 2.0]), "strictly positive"),
    (CENTERS[:3], torch.tensor([1.0, float("nan"), 2.0]), "strictly positive"),
])
def test_rejects_what_exact_dp_rejects(centers, counts, match):
    with pytest.raises(ValueError, match=match):
        quantization.exact_dp({"active_centers": centers, "active_counts": counts}, 2, True)
    with pytest.raises(ValueError, match=match):
        cs.solve_codebook(centers, counts, 2, True)


def test_rejects_bad_shapes_and_sizes():
    with pytest.raises(ValueError, match="same length"):
        cs.solve_codebook(CENTERS[:3], torch.ones(4))
    with pytest.raises(ValueError, match="num_codebooks"):
        cs.solve_codebook(CENTERS[:3], torch.ones(3), 0)
    with pytest.raises(ValueError, match="empty histogram"):
        cs.codebook_from_counts(torch.zeros(BINS, dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D"):
        cs.codebook_from_counts(torch.ones(2, 2048, dtype=torch.int64))


def test_output_contract():
    out = cs.solve_codebook(CENTERS[::7].double(), torch.arange(1, 587, dtype=torch.int64))
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (256,)
    assert torch.all(out[1:] >= out[:-1]) and out[0] == -1.0 and out[-1] == 1.0


def test_benchmark_rows():
    counts = cs.histogram_counts(with_period(tiny_mlp_grads(7), 32))
    (row,) = bench_cs.benchmark([("tiny", counts)])
    assert row["identical"] is True and row["n_active"] == int((counts > 0).sum())
    assert row["reference_s"] > 0 and row["ours_s"] > 0 and row["full_scan_layers"] == 0
