"""Throughput of the reshard's dequantize / requantize: Triton kernels vs the torch reference.

    .venv/bin/python scripts/bench_quant.py                   # sizes by device: CPU 1M..64M, GPU 1M..1B
    .venv/bin/python scripts/bench_quant.py --sizes 1M 16M --repeat 5

The benchmark itself is ``benchmarks.quant`` (its docstring says
what is measured and how).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.quant import main

if __name__ == "__main__":
    main()
