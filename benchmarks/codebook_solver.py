"""gefen-x's exact-DP codebook solver vs ``gefen_titan.optim.codebook_solver``, on ten histograms.

    python scripts/bench_codebook_solver.py              # ~1-3 min: the reference is slow
    python scripts/bench_codebook_solver.py --no-reference

Per histogram: active bins N, seconds of ``gefen.quantization.exact_dp`` and of
``solve_codebook`` (both compiled and warmed up first), the speed-up, and
whether the two float32 codebooks have the same bits. ``benchmark_histograms``
makes the histograms, ``benchmark`` times them (tests/unit/test_codebook_solver.py
checks its rows on a tiny one).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import torch
from gefen import quantization

from gefen_titan.optim.codebook_solver import (
    histogram_counts,
    histogram_stats,
    solve_codebook,
    solve_codebook_full_scans,
)

__all__ = ["benchmark", "benchmark_histograms", "main"]


def _model_grads(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Gradients of a small MLP + embedding language-model-ish net."""
    g = torch.Generator().manual_seed(seed)
    vocab, dim, hidden, batch = 512, 128, 512, 64
    emb = torch.nn.Embedding(vocab, dim)
    up = torch.nn.Linear(dim, hidden)
    down = torch.nn.Linear(hidden, dim)
    head = torch.nn.Linear(dim, vocab, bias=False)
    with torch.no_grad():
        for p in (*emb.parameters(), *up.parameters(), *down.parameters(), *head.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    tokens = torch.randint(0, vocab, (batch, 16), generator=g)
    targets = torch.randint(0, vocab, (batch, 16), generator=g)
    h = emb(tokens)
    h = h + down(torch.nn.functional.gelu(up(h)))
    loss = torch.nn.functional.cross_entropy(head(h).reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    mods = {"emb": emb, "up": up, "down": down, "head": head}
    return [(f"{m}.{n}", p.grad) for m, mod in mods.items() for n, p in mod.named_parameters()]


def benchmark_histograms(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Ten realistic 4096-bin histograms: (name, int64 counts).

    Gradients of a small embedding/MLP net block-normalized at several periods,
    and block-normalized synthetic gradients (Gaussian, Laplace, Student-t,
    sparse) of a few million elements, like one refresh of a small model.
    """
    out = []
    grads = _model_grads(seed)
    for period in (32, 128, 512):
        pairs = [(t, period if t.numel() % period == 0 else 1) for _, t in grads]
        out.append((f"model grads, period {period}", histogram_counts(pairs)))
    pairs = [(t, t.shape[-1]) for _, t in grads]
    out.append(("model grads, period = row", histogram_counts(pairs)))
    g = torch.Generator().manual_seed(seed + 1)
    n = 1 << 22
    gauss = torch.randn(n, generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    laplace = sign * torch.empty(n).exponential_(generator=g)
    chi2_3 = torch.randn(3, n, generator=g).square().sum(0)
    student = torch.randn(n, generator=g) / (chi2_3 / 3.0).sqrt()  # Student-t, 3 dof
    sparse = gauss * (torch.rand(n, generator=g) < 0.05)
    mixed = torch.cat([gauss[: n // 2] * 1e-3, student[: n // 2]])
    out += [
        ("gaussian, period 64", histogram_counts([(gauss, 64)])),
        ("gaussian, period 1024", histogram_counts([(gauss, 1024)])),
        ("laplace, period 256", histogram_counts([(laplace, 256)])),
        ("student-t(3), period 256", histogram_counts([(student, 256)])),
        ("sparse 5% gaussian, period 128", histogram_counts([(sparse, 128)])),
        ("mixed scales, periods 16+4096", histogram_counts([(mixed, 16), (student, 4096)])),
    ]
    return out


def benchmark(
    histograms: Sequence[tuple[str, torch.Tensor]] | None = None,
    num_codebooks: int = 256,
    reference: bool = True,
) -> list[dict]:
    """Time gefen-x's ``exact_dp`` against ``solve_codebook``.

    One row per histogram: ``name``, ``n_active``, ``reference_s`` (None when
    ``reference`` is False), ``ours_s``, ``speedup``, ``identical`` (the float32
    codebooks have the same bits) and ``full_scan_layers`` (layers the near-tie
    guard sent to a full scan). Both compiled kernels are warmed up first, so
    compile time is not counted.
    """
    if histograms is None:
        histograms = benchmark_histograms()
    warm = torch.zeros(64, dtype=torch.int64)
    warm[::3] = 5
    warm_stats = histogram_stats(warm)
    solve_codebook(warm_stats["active_centers"], warm_stats["active_counts"], 8)
    if reference:
        quantization.exact_dp(warm_stats, 8, True)
    rows = []
    for name, counts in histograms:
        stats = histogram_stats(counts)
        t0 = time.perf_counter()
        ours, full_scans = solve_codebook_full_scans(stats["active_centers"], stats["active_counts"],
                                                     num_codebooks, True)
        ours_s = time.perf_counter() - t0
        row = {"name": name, "n_active": int(stats["active_centers"].numel()),
               "reference_s": None, "ours_s": ours_s, "speedup": None,
               "identical": None, "full_scan_layers": full_scans}
        if reference:
            t0 = time.perf_counter()
            ref = quantization.exact_dp(stats, num_codebooks, True)
            row["reference_s"] = time.perf_counter() - t0
            row["speedup"] = row["reference_s"] / ours_s if ours_s > 0 else math.inf
            row["identical"] = bool(
                ref.dtype == ours.dtype and ref.shape == ours.shape
                and torch.equal(ref.view(torch.int32), ours.view(torch.int32)))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="seed of the histograms")
    ap.add_argument("--num-codebooks", type=int, default=256)
    ap.add_argument("--no-reference", action="store_true",
                    help="time only our solver (no identity check)")
    args = ap.parse_args(argv)

    rows = benchmark(benchmark_histograms(args.seed), num_codebooks=args.num_codebooks,
                     reference=not args.no_reference)
    fmt = "{:<32} {:>5} {:>10} {:>8} {:>9} {:>10}"
    print(fmt.format("histogram", "N", "ref s", "ours s", "speed-up", "identical"))
    for r in rows:
        print(fmt.format(
            r["name"], r["n_active"],
            "-" if r["reference_s"] is None else f"{r['reference_s']:.3f}",
            f"{r['ours_s']:.3f}",
            "-" if r["speedup"] is None else f"{r['speedup']:.0f}x",
            "-" if r["identical"] is None else str(r["identical"])))
    ref_total = sum(r["reference_s"] or 0.0 for r in rows)
    ours_total = sum(r["ours_s"] for r in rows)
    all_identical = "-" if args.no_reference else str(all(r["identical"] for r in rows))
    speedup = "-" if args.no_reference else f"{ref_total / ours_total:.0f}x"
    print(fmt.format("total", "", "-" if args.no_reference else f"{ref_total:.3f}",
                     f"{ours_total:.3f}", speedup, all_identical))
    fallbacks = sum(r["full_scan_layers"] for r in rows)
    if fallbacks:
        print(f"({fallbacks} layers fell back to a full scan: no exactness certificate)")
