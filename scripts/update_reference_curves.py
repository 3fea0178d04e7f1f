#!/usr/bin/env python
"""Regenerate (or check) the stored loss curves of the CPU recipes.

    python scripts/update_reference_curves.py            # rewrite tests/reference_curves/*.json
    python scripts/update_reference_curves.py --check    # compare only; exit 1 on a deviation
    python scripts/update_reference_curves.py --recipes llama_gefen_mixed
    python scripts/update_reference_curves.py --drift host --recipes qwen3_moe_gefen --optimizer AdamW

The runs are pinned to torch's AVX2 CPU kernels (``ATEN_CPU_CAPABILITY=avx2``)
on every host; ``--drift`` measures how far another kernel set moves a curve.

The logic is ``tests.helpers.reference_curves`` (its docstring says what runs).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is a folder of the checkout, not of the wheel
from tests.helpers.reference_curves import main

if __name__ == "__main__":
    sys.exit(main())
