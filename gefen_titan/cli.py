"""The ``gefen-titan`` command: ``gefen-titan ckpt inspect|verify|convert|export ...`` and ``gefen-titan validate ...``.

Training has its own entry (``gefen-titan-train``, ``python -m
gefen_titan.train``); this command groups the tools that work on what
training wrote (``ckpt``) and the proof that a resume at another size or
layout is exact on your own cluster (``validate``, ``gefen_titan.validation.command``).
"""

from __future__ import annotations

import argparse
import sys

from gefen_titan.ckpt_tools import cli as ckpt_cli
from gefen_titan.validation import command as validation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gefen-titan",
                                     description="gefen-titan tools; training is gefen-titan-train.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ckpt_cli.add_commands(sub.add_parser("ckpt", help="inspect, verify, convert or export a checkpoint",
                                         description=ckpt_cli.DESCRIPTION))
    validation.add_arguments(sub.add_parser("validate", help="save at N ranks, resume at M (size or layout), compare",
                                            description=validation.DESCRIPTION))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "validate":
        options = vars(args)
        del options["command"]
        return validation.validate(**options)
    return ckpt_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
