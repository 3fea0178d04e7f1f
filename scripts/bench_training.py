"""Training cost inside torchtitan: the same recipe with Gefen and with AdamW (and GefenMuon).

    python scripts/bench_training.py                       # debug (10 steps) and 150M (4 steps, seq 128), 2 ranks
    python scripts/bench_training.py --models debug --steps 20
    python scripts/bench_training.py --models debug --ranks 2,4 --optimizers Gefen,AdamW,GefenMuon

The benchmark itself is ``benchmarks.training`` (its docstring
says what is measured and how).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.training import main

if __name__ == "__main__":
    main()
