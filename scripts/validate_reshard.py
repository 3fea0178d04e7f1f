#!/usr/bin/env python
"""End-to-end reshard validation: save at N ranks under one layout, resume at M under another.

    python scripts/validate_reshard.py --recipe recipes/llama_gefen.toml --from 2 --to 4
    python scripts/validate_reshard.py --pairs 2:4,4:2,2:1
    python scripts/validate_reshard.py --pairs 2:4,4:2,2:1 --blocking per_rank   # format v1
    python scripts/validate_reshard.py --recipe recipes/llama_gefen_global_order.toml --pairs 2:2@tp2
                                       # a side N@LAYOUT names its degrees (docs/validation.md)

Trains an uninterrupted reference at side N that checkpoints at step S,
resumes that checkpoint at side M with torchrun, and compares the state
right after the load with the saved state (agreed blocking, the default:
bit-exact for every pair; per-rank blocking: exact where the v1 adapter
promises it, else within its bounds) and the losses with a measured band.
Prints a table, writes report.json and a PNG of the loss curves, exits 1
naming each pair and figure that broke its tolerance (2 if a reference run
failed). The method: ``gefen_titan.validation.command`` and docs/validation.md.

The installed package has the same command, ``gefen-titan validate``, which
takes a recipe from the current directory only; this checkout's script also
finds the checkout's recipes (``recipes/...``) from any directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gefen_titan.validation import command

CHECKOUT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(ap, recipe_default="recipes/llama_gefen.toml")
    args = ap.parse_args(argv)
    if not Path(args.recipe).is_absolute() and not Path(args.recipe).exists() and (CHECKOUT / args.recipe).exists():
        args.recipe = str(CHECKOUT / args.recipe)  # a recipe of the checkout, run from elsewhere
    return command.validate(**vars(args))


if __name__ == "__main__":
    sys.exit(main())
