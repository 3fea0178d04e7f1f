"""Every optimizer kind's records in a checkpoint, read and checked offline (formats v3, v2 and v1).

The checks are the load's own, not a copy: ``checkpoint.checks.record_checks``
(the record stage of ``checkpoint.checks.load_checks``, which runs each registered
kind's description), which the load runs on its one small read of the
records (``optim.checkpointing.load_context``) and the tools run here on theirs.
What is left to the load is what needs the live model (the parameters'
shapes, the mesh's cuts, ``deterministic``).
"""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.components.checkpoint import OPTIMIZER

from gefen_titan.checkpoint.checks.record_checks import SavedRecords, read_saved, small_names
from gefen_titan.checkpoint.format import schema
from gefen_titan.ckpt_tools.view import Checkpoint, CkptError

__all__ = ["SavedRecords", "read_records", "codebook_summary", "optimizer_entries"]


def codebook_summary(cb: torch.Tensor) -> dict[str, Any]:
    cb = cb.float()
    distinct = torch.unique(cb)
    pos = cb[cb > 0]
    neg = cb[cb < 0]
    return {
        "entries": int(cb.numel()),
        "distinct": int(distinct.numel()),
        "min": float(cb.min()),
        "max": float(cb.max()),
        "smallest_positive": float(pos.min()) if pos.numel() else None,
        "largest_negative": float(neg.max()) if neg.numel() else None,
        "sorted": bool((cb[1:] >= cb[:-1]).all()),
    }


def optimizer_entries(ck: Checkpoint) -> dict[str, Any]:
    """The optimizer component's entries (names inside it) -> their DCP metadata, as a load sees them."""
    md = ck.metadata.state_dict_metadata
    return {name: md[e.key] for name, e in ck.optimizer.items()}


def read_records(ck: Checkpoint) -> SavedRecords | None:
    """The checkpoint's records of every kind (None: it holds no ``gefen/`` state).

    Raises ``CkptError`` when the header is unreadable or of an unknown
    format; everything else wrong is collected in ``problems``.
    """
    if schema.header_key() not in ck.optimizer:
        return None
    entries = optimizer_entries(ck)
    values = ck.load_names(OPTIMIZER, small_names(entries))
    try:
        return read_saved(entries, values)
    except schema.FormatError as e:
        raise CkptError(f"{ck.path}: {e}; run `gefen-titan ckpt verify` on it") from e
