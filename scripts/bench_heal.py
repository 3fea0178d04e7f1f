"""What a torchft heal moves and costs, for Gefen, GefenMuon and AdamW in one run.

    python scripts/bench_heal.py
    python scripts/bench_heal.py --optimizers Gefen --steps 6

The benchmark itself is ``benchmarks.heal`` (its docstring says what is measured).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.heal import main

if __name__ == "__main__":
    main()
