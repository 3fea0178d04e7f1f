"""Benchmark optimizer checkpoints: gefen-titan (v2 and v1) vs gefen-x GefenDCPState vs AdamW.

    python scripts/bench_checkpoint.py                   # save at 2, load at 2, 4, 1
    python scripts/bench_checkpoint.py --save-ranks 4 --load-ranks 4,2

The benchmark itself is ``gefen_titan.benchmarks.checkpoint`` (its docstring
says what is measured and how).
"""

from gefen_titan.benchmarks.checkpoint import main

if __name__ == "__main__":
    main()
