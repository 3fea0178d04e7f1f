"""Training quality: agreed vs per-rank blocking vs one process, against Gefen's seed noise
(and, with --runs, GefenMuon's loss curve against Gefen's and AdamW's).

    python scripts/bench_quality.py --steps 100
    python scripts/bench_quality.py --steps 100 --runs agreed,adamw,gefen-muon

The benchmark itself is ``benchmarks.quality``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.quality import main

if __name__ == "__main__":
    main()
