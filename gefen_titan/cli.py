"""The ``gefen-titan`` command: ``gefen-titan ckpt inspect|verify|convert ...``.

Training has its own entry (``gefen-titan-train``, ``train.py``); this
command groups the tools that work on what training wrote.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from gefen_titan.ckpt import cli as ckpt_cli

    parser = argparse.ArgumentParser(prog="gefen-titan", description="gefen-titan tools; training is train.py / gefen-titan-train.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ckpt_cli.add_commands(sub.add_parser("ckpt", help="inspect, verify or convert a checkpoint",
                                         description=ckpt_cli.DESCRIPTION))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return ckpt_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
