"""Gefen's CPU step (the kernel) against torch's fused and foreach AdamW, one process, interleaved.

    .venv/bin/python scripts/bench_cpu_step.py                 # 6M and 50M, 1 and 2 threads
    .venv/bin/python scripts/bench_cpu_step.py --models 6M --threads 1 --gefen-x

The benchmark itself is ``benchmarks.cpu_step`` (its docstring says what is
measured and how).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.cpu_step import main

if __name__ == "__main__":
    main()
