"""Training quality: agreed vs per-rank blocking vs one process, against Gefen's seed noise.

    python scripts/bench_quality.py --steps 100

The benchmark itself is ``gefen_titan.benchmarks.quality``.
"""

from gefen_titan.benchmarks.quality import main

if __name__ == "__main__":
    main()
