"""Compact, reshardable Gefen checkpoints.

Two format versions (``format.py``): v2, written under agreed blocking and
resharded by DCP alone (``agreed.py``), and v1, written under per-rank
blocking and re-blocked on load (``adapter.py``). The container picks the
save adapter from ``optimizer.blocking`` and the load adapter from the
checkpoint's header (``checkpoint_blocking``).
"""

from __future__ import annotations

import json
from typing import Any

from gefen_titan.checkpoint import schema as fmt
from gefen_titan.checkpoint.errors import GefenCheckpointError, agree, read_small, unreadable
from gefen_titan.optim.state.agreed import AgreedStateAdapter
from gefen_titan.optim.state.per_rank import PerRankStateAdapter

__all__ = ["AgreedStateAdapter", "GefenCheckpointError", "PerRankStateAdapter", "checkpoint_blocking", "unreadable"]


def checkpoint_blocking(checkpoint_id: str, metadata: Any, prefix: str, has_gefen: bool) -> str:
    """``"agreed"`` (format v2) or ``"per_rank"`` (v1) for a checkpoint. Collective.

    Raises ``GefenCheckpointError`` on every rank when the checkpoint holds no
    gefen-titan Gefen state that a rank with Gefen parameters could load.
    """
    key = fmt.format_key()
    error, blocking = None, None
    if prefix + key not in metadata.state_dict_metadata:
        foreign = sorted(k[len(prefix):] for k in metadata.state_dict_metadata
                         if k.startswith(prefix + "state."))[:3]
        what = (f"it holds another optimizer's state ({', '.join(foreign)} ...)" if foreign
                else "it holds no Gefen state in the gefen-titan format")
        if has_gefen:
            error = (f"{what}. To start Gefen fresh from this checkpoint's model, set "
                     "checkpoint.exclude_from_loading = [\"optimizer\"] (and lr_scheduler if needed)")
    else:
        header = json.loads(read_small(checkpoint_id, metadata, prefix, [], [key])[key])
        version = header.get("version")
        if header.get("format") != fmt.FORMAT or version not in (fmt.V1, fmt.VERSION):
            error = (f"checkpoint format {header} is not {fmt.FORMAT} v{fmt.V1} or v{fmt.VERSION}; it was "
                     "written by another gefen-titan version. Load it with that version or exclude the optimizer")
        else:
            blocking = "agreed" if version == fmt.VERSION else "per_rank"
    agree(error, f"cannot load Gefen optimizer state from {checkpoint_id}")
    return blocking or "agreed"
