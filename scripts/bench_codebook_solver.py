"""gefen-x's exact-DP codebook solver vs gefen_titan.optim.codebook_solver, on ten histograms.

    python scripts/bench_codebook_solver.py              # ~1-3 min: the reference is slow
    python scripts/bench_codebook_solver.py --no-reference

The benchmark itself is ``benchmarks.codebook_solver`` (its docstring says
what is measured and how).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.codebook_solver import main

if __name__ == "__main__":
    main()
