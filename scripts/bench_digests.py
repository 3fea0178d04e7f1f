"""What one rank reads of ``.digests`` to load a checkpoint saved by many ranks (current vs file version 1).

    python scripts/bench_digests.py                       # 405B under FSDP at 1,024 ranks (~30 s)
    python scripts/bench_digests.py --world 64

The benchmark itself is ``benchmarks.digests`` (its docstring says what is
measured and how).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.digests import main

if __name__ == "__main__":
    main()
