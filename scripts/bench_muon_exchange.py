"""GefenMuon's exchange: packed point-to-point against all_to_all_single on the same bytes.

    python scripts/bench_muon_exchange.py
    python scripts/bench_muon_exchange.py --ranks 2 --mib 256 --rounds 9

The benchmark itself is ``benchmarks.muon_exchange`` (its docstring says what is measured).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.muon_exchange import main

if __name__ == "__main__":
    main()
