"""gefen-x's exact-DP codebook solver vs gefen_titan.optim.codebook_solver, on ten histograms.

    .venv/bin/python scripts/bench_codebook_solver.py              # ~1-3 min: the reference is slow
    .venv/bin/python scripts/bench_codebook_solver.py --no-reference

Per histogram: active bins N, seconds of ``gefen.quantization.exact_dp`` and of
``solve_codebook`` (both compiled and warmed up first), the speed-up, and
whether the two float32 codebooks have the same bits. The histograms and the
timing live in ``gefen_titan.optim.codebook_solver.benchmark``.
"""

from __future__ import annotations

import argparse

from gefen_titan.optim.codebook_solver import benchmark, benchmark_histograms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="seed of the histograms")
    ap.add_argument("--num-codebooks", type=int, default=256)
    ap.add_argument("--no-reference", action="store_true",
                    help="time only our solver (no identity check)")
    args = ap.parse_args()

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


if __name__ == "__main__":
    main()
