"""Which parallel layouts torchtitan 0.3.0's MoE models train in on CPU, and their placements.

    .venv/bin/python scripts/probe_moe_layouts.py                          # recipes/qwen3_moe_gefen.toml
    .venv/bin/python scripts/probe_moe_layouts.py --recipe recipes/dsv3_gefen.toml --layouts "EP 2,EP 4"

Prints a markdown table (docs/moe.md holds the one it printed). The probe is
``tools.moe_layouts`` (its docstring says what runs).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: a folder of the checkout, not the wheel
from tools import moe_layouts as ml

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/qwen3_moe_gefen.toml")
    ap.add_argument("--flavor", help="another flavor than the recipe's (e.g. debugmodel_moe_2e)")
    ap.add_argument("--layouts", help="comma-separated layout names (default: all of tools.moe_layouts.LAYOUTS)")
    ap.add_argument("--out", default="outputs/moe_layouts")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = ap.parse_args()
    wanted = {n.strip() for n in args.layouts.split(",")} if args.layouts else None
    layouts = [ml.Layout(la.name, la.nproc, la.flags, args.flavor or la.flavor) for la in ml.LAYOUTS
               if wanted is None or la.name in wanted]
    if wanted and (missing := wanted - {la.name for la in layouts}):
        raise SystemExit(f"unknown layouts {sorted(missing)} (known: {[la.name for la in ml.LAYOUTS]})")
    results = []
    for layout in layouts:
        results.append(ml.probe(str(Path(args.recipe).resolve()), layout, Path(args.out).resolve(), args.timeout))
        r = results[-1]
        print(f"{layout.name}: {r.status} ({r.seconds:.0f} s): {r.detail}", file=sys.stderr, flush=True)
    print(ml.table(results))
