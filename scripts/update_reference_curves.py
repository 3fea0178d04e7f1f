#!/usr/bin/env python
"""Regenerate (or check) the stored loss curves of the CPU recipes.

    python scripts/update_reference_curves.py            # rewrite tests/reference_curves/*.json
    python scripts/update_reference_curves.py --check    # compare only; exit 1 on a deviation
    python scripts/update_reference_curves.py --recipes llama_gefen_mixed

The logic is ``gefen_titan.reference_curves`` (its docstring says what runs).
"""

import sys

from gefen_titan.reference_curves import main

if __name__ == "__main__":
    sys.exit(main())
