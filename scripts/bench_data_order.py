#!/usr/bin/env python
"""Benchmark the global-order data path on a corpus 100x the embedded one.

    python scripts/bench_data_order.py                  # x100 corpus in a temp dir, removed afterwards
    python scripts/bench_data_order.py --factor 20 --workdir /tmp/bench --keep

Prints: the time to build the embedded corpus and the big one (tokens/s);
the big corpus's size; the loader's tokens/s per rank at the debug recipe's
shape and at a 2048-token shape, with the anonymous memory it kept (RssAnon:
a whole-corpus load would show here) and the mapped pages it touched
(RssFile); and the training step's tokens/s (recipes/llama_gefen_global_order.toml,
1 rank, data loading excluded), which the loader has to outrun. Loader and
training figures come from fresh processes. The logic is
benchmarks.data (``main``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the checkout's, not in the wheel
from benchmarks.data import main

if __name__ == "__main__":
    main()
