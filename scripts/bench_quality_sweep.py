"""Held-out quality of AdamW, Gefen (block / factored second moment) and GefenMuon, each at its best LR,
against seed noise (issue 48). Resumable: a rerun with the same --out skips finished runs.

    python scripts/bench_quality_sweep.py --dry-run
    python scripts/bench_quality_sweep.py --out outputs/quality_sweep
    python scripts/bench_quality_sweep.py --steps 40 --sweep-steps 20 --lrs 1e-3,4e-3 --out /tmp/qs

The benchmark itself is ``benchmarks.quality_sweep``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.quality_sweep import main

if __name__ == "__main__":
    main()
