"""Training cost inside torchtitan: the same recipe with Gefen and with AdamW.

    python scripts/bench_training.py                       # debug (10 steps) and 150M (4 steps, seq 128), 2 ranks
    python scripts/bench_training.py --models debug --steps 20

The benchmark itself is ``gefen_titan.benchmarks.training`` (its docstring
says what is measured and how).
"""

from gefen_titan.benchmarks.training import main

if __name__ == "__main__":
    main()
