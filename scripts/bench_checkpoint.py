"""Benchmark optimizer checkpoints: gefen-titan (v2 and v1) vs gefen-x GefenDCPState vs AdamW.

    python scripts/bench_checkpoint.py                   # save at 2, load at 2, 4, 1
    python scripts/bench_checkpoint.py --save-ranks 4 --load-ranks 4,2

The benchmark itself is ``benchmarks.checkpoint`` (its docstring
says what is measured and how).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.checkpoint import main

if __name__ == "__main__":
    main()
