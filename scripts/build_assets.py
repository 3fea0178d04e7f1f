#!/usr/bin/env python
"""Rebuild gefen_titan's embedded default corpus and tokenizer, offline.

    python scripts/build_assets.py            # rewrites gefen_titan/assets/{tiny_corpus,tokenizer}
    python scripts/build_assets.py --check    # rebuilds in a temp dir, compares sha256s (exit 1 on drift)

The logic is ``tools.assets`` (its docstring says what is built, from what,
and why the bytes are reproducible).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: the checkout's, not in the wheel
from tools.assets import main

if __name__ == "__main__":
    sys.exit(main())
