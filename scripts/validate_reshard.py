#!/usr/bin/env python
"""End-to-end reshard validation: save at N data-parallel ranks, resume at M.

    python scripts/validate_reshard.py --recipe recipes/llama_gefen.toml --from 2 --to 4
    python scripts/validate_reshard.py --pairs 2:4,4:2,2:1
    python scripts/validate_reshard.py --pairs 2:4,4:2,2:1 --blocking per_rank   # format v1

Trains an uninterrupted reference at N ranks that checkpoints at step S,
resumes that checkpoint at M ranks with torchrun, and compares the state
right after the load with the saved state (agreed blocking, the default:
bit-exact for every pair; per-rank blocking: exact where the v1 adapter
promises it, else within its bounds) and the losses with a measured band.
Prints a table, writes report.json and a PNG of the loss curves, exits 1
naming each pair and figure that broke its tolerance (2 if a reference run
failed). The method: ``gefen_titan.validation.core`` and docs/validation.md.
"""

from __future__ import annotations

import argparse
import sys

from gefen_titan.validation import core as validation


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/llama_gefen.toml")
    ap.add_argument("--from", dest="source", type=int)
    ap.add_argument("--to", dest="target", type=int)
    ap.add_argument("--pairs", help="comma-separated N:M pairs, e.g. 2:4,4:2,2:1")
    ap.add_argument("--steps-before", type=int, default=4, help="S: checkpoint step (default 4)")
    ap.add_argument("--steps-after", type=int, default=3, help="K: steps after the resume (default 3)")
    ap.add_argument("--global-batch", type=int, default=16, help="training.global_batch_size for every run (0: the recipe's)")
    ap.add_argument("--local-batch", type=int, help="training.local_batch_size (default: the recipe's)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE", help="another override for every run")
    ap.add_argument("--blocking", choices=("agreed", "per_rank"),
                    help="optimizer.blocking for every run (default: the recipe's, normally agreed)")
    ap.add_argument("--out", default="outputs/validate_reshard", help="folder for the runs, report.json and the plot")
    ap.add_argument("--plot", dest="plot_path", metavar="PNG", help="PNG path (default <out>/loss_curves.png)")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    ap.add_argument("--reference-cache", help="keep reference runs here and reuse those of the same identity")
    ap.add_argument("--inject-fault", choices=("drop-optimizer",), help=argparse.SUPPRESS)
    return validation.validate(**vars(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
