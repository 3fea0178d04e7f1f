#!/usr/bin/env python
"""Tokenize text into a memory-mapped token dataset for the global-order loader.

    python scripts/build_indexed_dataset.py corpus.jsonl.gz --out data/mycorpus
    python scripts/build_indexed_dataset.py docs/ more.jsonl --out data/mix --tokenizer path/to/hf_assets

Then set ``[dataloader] loader = "global_order"`` and ``dataset_path =
"data/mycorpus"``. Rerun the same command after an interruption to resume.
The logic is ``gefen_titan.data.indexed_build`` (``--help`` for the options).
"""

import sys

from gefen_titan.data.indexed_build import main

if __name__ == "__main__":
    sys.exit(main())
