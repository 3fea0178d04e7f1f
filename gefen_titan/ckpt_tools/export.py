"""``gefen-titan ckpt export``: a whole checkpoint as one ``torch.save`` file, for torch's own tools.

DCP's ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns a
DCP folder into one ``torch.save`` file, but it reads through DCP's own
reader, which refuses format v3's raw Gefen entries (they are stored bytes,
not ``torch.save`` frames: ``Weights only load failed ... Unsupported operand
94``). This writes the same kind of file from gefen-titan's reader
(``checkpoint.io.storage.load_all``: every entry nested as it was saved, every
byte checked against ``.digests``, nothing unpickled beyond plain data), so
``torch.load(path, weights_only=True)`` reads it, after the load's value
checks (a magnitude or second moment non-finite or negative is refused, as the
resume refuses it): tensors (DTensors saved
whole, at their global shape; Gefen's uint8 codes and packed block grids as
they are on disk), the records' JSON strings, the data loader's and the
train state's plain values.

The file is written beside ``OUT`` and renamed into place (a failure leaves
nothing); ``OUT`` must not exist. Memory: the whole checkpoint, once.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torchtitan.components.checkpoint import OPTIMIZER

from gefen_titan.checkpoint.errors import GefenCheckpointError, root_cause
from gefen_titan.checkpoint.format import kinds
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.verify_items import nonnegative_entry
from gefen_titan.ckpt_tools.view import CkptError
from gefen_titan.optim.kinds import register_builtins

__all__ = ["export", "render"]


def _count(value: Any, acc: dict[str, int]) -> None:
    if isinstance(value, torch.Tensor):
        acc["tensors"] += 1
        acc["tensor_bytes"] += value.numel() * value.element_size()
    elif isinstance(value, dict):
        for v in value.values():
            _count(v, acc)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _count(v, acc)
    else:
        acc["other"] += 1


def _check_values(path: str, sd: dict[str, Any]) -> None:
    """The load's value checks of what ``storage.load_all`` read (the byte entries' ran as it read them):
    a magnitude or second moment non-finite or negative is refused (``verify_items.nonnegative_entry``)."""
    for name, value in (sd.get(OPTIMIZER) or {}).items():
        if isinstance(value, torch.Tensor) and nonnegative_entry(OPTIMIZER, name):
            why = kinds.nonnegative_problem(value)
            if why:
                raise CkptError(f"{path}: entry {OPTIMIZER}.{name}: a magnitude or second moment with {why}: the "
                                f"resume refuses this checkpoint; `gefen-titan ckpt verify {path}` lists what is "
                                "wrong. Nothing was written")


def export(path: str, out: str) -> dict[str, Any]:
    register_builtins()  # the built-in kinds' descriptions, which its checks read
    if os.path.exists(out):
        raise CkptError(f"{out} exists: give export a new file name (nothing was written)")
    if not os.path.isdir(path):
        raise CkptError(f"{path} is not a checkpoint folder (a step-N folder with a .metadata file)")
    try:
        sd = storage.load_all(path)
    except (GefenCheckpointError, CkptError):
        raise
    except Exception as e:  # a damaged file the reader has no word for (a .digests index of wrong types)
        raise CkptError(f"cannot read checkpoint {path} ({root_cause(e)}): a file is damaged or was not written "
                        f"by a save; `gefen-titan ckpt verify {path}` names it. Nothing was written") from e
    _check_values(path, sd)
    tmp = f"{out}.partial-{os.getpid()}"
    try:
        torch.save(sd, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    counts = {"tensors": 0, "tensor_bytes": 0, "other": 0}
    _count(sd, counts)
    return {"ok": True, "source": path, "out": out, "top_level_entries": len(sd), **counts,
            "file_bytes": os.path.getsize(out), "read_with": "torch.load(path, weights_only=True)"}


def render(report: dict[str, Any]) -> str:
    return (f"exported {report['source']}\n"
            f"      to {report['out']} ({report['file_bytes']:,} bytes): {report['tensors']} tensors "
            f"({report['tensor_bytes']:,} bytes), {report['other']} other values\n"
            f"read:    {report['read_with']}")
