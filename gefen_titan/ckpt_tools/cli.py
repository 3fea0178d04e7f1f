"""Command line of the checkpoint tools.

Exit status: 0 the command did what it says (``verify``: the checkpoint is
sound and every byte matched its ``.digests``); 1 the checkpoint is bad,
unreadable or cannot be converted (the message says what to do; nothing
was written); 2 a wrong command line; 3 (``verify``) no problem found, but
the checkpoint predates digests, so its bytes are unchecked.
``--digest-key-env NAME``: the environment variable holding the key the
checkpoint was signed with (``checkpoint.digest_key_env``).
With ``--json`` the report is the only thing on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gefen_titan.checkpoint import progress
from gefen_titan.checkpoint.errors import CONVERT_TARGETS, GefenCheckpointError
from gefen_titan.checkpoint.format import digests
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools import convert, export, inspection, verify
from gefen_titan.ckpt_tools.view import CkptError

DESCRIPTION = ("Inspect, verify, convert or export a gefen-titan / torchtitan DCP checkpoint "
               "(one step-N folder).")
OK, BAD, USAGE, UNCHECKED = 0, 1, 2, 3


def add_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    p = sub.add_parser("inspect", help="what a checkpoint holds, as a table",
                       description="Format, the mesh it was saved on, per optimizer the parameters with shapes, "
                                   "periods, bytes, codebooks and step counters, the model and data-loader entries.")
    p.add_argument("path", metavar="PATH", help="a checkpoint folder, e.g. outputs/llama_gefen/checkpoint/step-10")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _key_option(p)

    p = sub.add_parser("verify", help="offline integrity check of every file and record",
                       description="Reads every byte of every file (CRC32 of every stored record), checks the "
                                   "chunk tiling, Gefen's records, grids and codebooks and non-finite values. "
                                   "Exit status 0: sound, every byte matched .digests; 1: a problem (the first bad "
                                   "file is named); 3: no problem, but no .digests (a format from before them).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _key_option(p)

    p = sub.add_parser("convert", help="Gefen state to AdamW moments, or AdamW moments to Gefen state",
                       description="Writes a new checkpoint (OUT must not exist) with the optimizer state "
                                   "converted and every other entry copied, which train.py resumes: put it at "
                                   "<dump_folder>/<checkpoint.folder>/step-N of the run that resumes it.")
    p.add_argument("path", metavar="PATH", help="the checkpoint to convert")
    p.add_argument("out", metavar="OUT", help="the new checkpoint folder, e.g. outputs/run_adamw/checkpoint/step-10")
    p.add_argument("--to", required=True, choices=CONVERT_TARGETS, help="the optimizer state to write")
    p.add_argument("--implementation", default="fused", choices=("fused", "foreach", "for-loop"),
                   help="--to adamw: torchtitan's optimizer.implementation to record in the AdamW param groups "
                        "(default: fused, torchtitan's default)")
    p.add_argument("--max-tensor-parallel-degree", type=int, default=1, metavar="N",
                   help="--to gefen: periods also fit the last-dim cuts of every TP degree dividing N "
                        "(the recipe's optimizer.blocking.max_tensor_parallel_degree; default 1)")
    p.add_argument("--period-one-substrings", default="", metavar="A,B",
                   help="--to gefen: parameter name substrings kept at period 1 (the recipe's "
                        "optimizer.gefen.period_one_substrings)")
    p.add_argument("--deterministic", action="store_true",
                   help="--to gefen: mark the state for optimizer.gefen.deterministic = true")
    p.add_argument("--second-moment", default="factored", choices=("block", "factored"),
                   help="--to gefen: the second moment to write, as the recipe's optimizer.gefen.second_moment "
                        "(factored, the default: row and column means of exp_avg_sq for every parameter of two "
                        "dims or more; block: their block means)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _key_option(p)

    p = sub.add_parser("export", help="the whole checkpoint as one torch.save file (weights_only readable)",
                       description="What DCP's dcp_to_torch_save writes, for format v3 too (whose raw Gefen "
                                   "entries DCP's own reader refuses): every entry, checked, in one file that "
                                   "torch.load(path, weights_only=True) reads. OUT must not exist.")
    p.add_argument("path", metavar="PATH", help="the checkpoint folder")
    p.add_argument("out", metavar="OUT", help="the file to write, e.g. step-10.pt")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _key_option(p)


def _key_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--digest-key-env", default="", metavar="NAME",
                   help="environment variable holding the key the checkpoint was signed with (the recipe's "
                        "checkpoint.digest_key_env); its value is never printed")


def _emit(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    try:
        if args.json:
            json.dump(report, sys.stdout, indent=2, default=str)
            sys.stdout.write("\n")
        else:
            print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _fail(args: argparse.Namespace, message: str) -> int:
    if args.json:
        json.dump({"ok": False, "error": message}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    print(f"error: {message}", file=sys.stderr)
    return BAD


def _checkpoint_bytes(path: str) -> int | None:
    """Bytes of a checkpoint's data files (DCP's ``*.distcp``): the reading bar's total (None: not a folder
    here). The items read are those files' bytes; ``.metadata`` and ``.digests`` are read before the bar."""
    try:
        return sum(storage.file_size(path, name) or 0 for name in storage.list_files(path) if name.endswith(".distcp"))
    except OSError:
        return None


def run(args: argparse.Namespace) -> int:
    """One tool on one checkpoint; ``verify``, ``convert`` and ``export`` read the whole of it, with a
    progress bar in bytes on a terminal (``checkpoint.progress.reading``)."""
    if args.action == "inspect":
        return _run(args)
    with progress.reading(_checkpoint_bytes(args.path), f"{args.action}: reading"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        key = digests.key_from_env(args.digest_key_env)
        if args.action == "inspect":
            with digests.keyed(key):
                report = inspection.inspect_checkpoint(args.path)
            _emit(args, report, inspection.render(report))
            return OK
        if args.action == "verify":
            report = verify.verify_checkpoint(args.path, key)
            _emit(args, report, verify.render(report))
            return {"verified": OK, "unchecked": UNCHECKED}.get(report["verdict"], BAD)
        if args.action == "convert":
            options = convert.ConvertOptions(
                implementation=args.implementation,
                max_tensor_parallel_degree=args.max_tensor_parallel_degree,
                period_one_substrings=tuple(s for s in args.period_one_substrings.split(",") if s),
                deterministic=args.deterministic, second_moment=args.second_moment)
            with digests.keyed(key):  # read checked with the key; written signed with it
                report = convert.convert(args.path, args.out, args.to, options)
            _emit(args, report, convert.render(report))
            return OK
        if args.action == "export":
            with digests.keyed(key):
                report = export.export(args.path, args.out)
            _emit(args, report, export.render(report))
            return OK
    except (CkptError, GefenCheckpointError) as e:  # GefenCheckpointError: an unset key variable
        return _fail(args, str(e))
    raise AssertionError(args.action)


def main(argv: list[str] | None = None, prog: str = "gefen-titan ckpt") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_commands(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))
