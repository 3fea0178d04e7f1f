"""What both checkpoint format versions share: errors, agreement, checks.

Every check here runs on values every rank read identically, and every
failure goes through ``agree`` so all ranks raise the same error together
(a rank that raised alone would leave the others hanging in the next
collective).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from gefen_titan.checkpoint import schema

__all__ = ["GefenCheckpointError", "root_cause", "unreadable", "agree", "HYPER", "check_hyper", "check_codebook", "read_small"]

# Group hyperparameters carried in the checkpoint and restored on load (torch
# optimizers restore theirs the same way; the LR scheduler then resets lr).
HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")


class GefenCheckpointError(RuntimeError):
    """A Gefen checkpoint that cannot be loaded into (or saved from) the live optimizer."""


def root_cause(error: Exception) -> str:
    """The innermost ``XError: message`` line of an exception (DCP's
    CheckpointException wraps per-rank tracebacks)."""
    causes = re.findall(r"^\s*([\w.]+(?:Error|Exception): .+)$", str(error), re.M)
    cause = causes[-1] if causes else f"{type(error).__name__}: {str(error).strip()[:200]}"
    return cause[:300]


def unreadable(checkpoint_id: str, error: Exception) -> GefenCheckpointError:
    return GefenCheckpointError(
        f"cannot read checkpoint {checkpoint_id} ({root_cause(error)}): a file is "
        "missing, truncated or unreadable. Restore it, or resume from another step with "
        "checkpoint.load_step. Nothing was loaded into the optimizer."
    )


def agree(error: str | None, what: str) -> None:
    """Raise ``error`` on every rank if any rank has one (no rank hangs)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error:
            raise GefenCheckpointError(f"{what}: {error}")
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if error else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    lines = sorted({e for e in errors if e})
    raise GefenCheckpointError(f"{what}: " + "; ".join(lines))


def check_hyper(fqn: str, group: dict[str, Any]) -> None:
    """Group hyperparameters that Gefen can represent (or GefenCheckpointError)."""
    for k in HYPER:
        v = group.get(k)
        if not isinstance(v, (int, float)) or not (v == v) or v < 0:
            raise GefenCheckpointError(f"{fqn}: hyperparameter {k}={v!r} in the checkpoint is invalid")
    if not (group["beta1"] < 1 and group["beta2"] < 1 and group["eps"] > 0):
        raise GefenCheckpointError(f"{fqn}: checkpoint hyperparameters {group} cannot be represented by Gefen")


def check_codebook(cb: torch.Tensor, what: str) -> torch.Tensor:
    """Gefen's load validation: fp32 [256], finite, sorted, ends exactly -1 and +1."""
    cb = cb.float()
    if cb.numel() != schema.K or not torch.isfinite(cb).all() or cb[0] != -1 or cb[-1] != 1 or (cb[1:] < cb[:-1]).any():
        raise GefenCheckpointError(f"{what} is corrupt (must be {schema.K} sorted finite values from -1 to 1)")
    return cb


def read_small(checkpoint_id: str, metadata: Any, prefix: str, tensors: list[str], strings: list[str]) -> dict[str, Any]:
    """One small ``dcp.load`` of the named entries (keys without ``prefix``).

    Collective: every rank calls it with the same keys.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from gefen_titan.checkpoint.storage import storage_reader

    md = metadata.state_dict_metadata
    small: dict[str, Any] = {prefix + k: torch.empty(md[prefix + k].size, dtype=md[prefix + k].properties.dtype)
                             for k in tensors}
    small.update({prefix + k: "" for k in strings})
    try:
        dcp.load(small, storage_reader=storage_reader(checkpoint_id))
    except (Exception, CheckpointException) as e:  # DCP raises it on every rank
        raise unreadable(checkpoint_id, e) from e
    return {k[len(prefix):]: v for k, v in small.items()}
