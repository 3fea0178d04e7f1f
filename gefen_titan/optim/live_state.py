"""One rank's live optimizer state as plain data, and back: the optimizer part of a torchft heal.

A replica group that rejoins a fault-tolerant run (``gefen_titan.ft``)
takes its state from the same rank of a live group. Both groups run the same
recipe on the same mesh, so rank ``r`` of one holds exactly the shards rank
``r`` of the other holds: no resharding, no checkpoint format, only a copy.
``capture`` therefore takes every entry of every optimizer's per-parameter
state verbatim (torch's ``optimizer.state``: Gefen's codes, block grids,
periods and counters; GefenMuon's momentum and NorMuon rows; AdamW's
moments), every param group's values (the LR the scheduler set, betas, ...),
and for the Gefen family the job's codebook and global step
(``gefenx``). Copying all of it, caches included, is what makes the
joiner's next step bit-identical to its peer's; a curated subset would be a
second checkpoint format to keep in step with gefen-x.

Constraints a reader would otherwise re-break:
- ``capture`` runs on torchft's quorum thread while the main thread trains:
  no collective, and no copy (the transport reads the tensors before the
  peer's next optimizer step, which waits for the transfer).
- The result holds only tensors, str, int, float, bool, None, lists, tuples
  and dicts, so the joiner unpickles it with ``weights_only=True``
  (``ft.transport``). DTensor values travel as their local shard plus the
  global shape.
- ``check`` and ``restore`` make no collective: torchft hands each rank its
  heal on its own, and at a step-0 sync rank 0 of a group may load from
  another group while rank 1 of the same group serves it (seen here).
  ``restore`` checks everything before it changes anything; ``ft.heal``
  runs ``check`` when a heal arrives and ``restore`` only once every rank of
  the group has its heal, so the group installs on all of its ranks or none.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from gefen_titan.distributed import like_param, local
from gefen_titan.errors import UserError
from gefen_titan.optim import gefenx as gx

__all__ = ["LiveStateError", "capture", "check", "payload_bytes", "restore"]

_PLAIN = (str, int, float, bool, type(None))
_NOT_VALUES = ("params", "param_names")  # a group's parameters: the live ones stay


class LiveStateError(UserError, RuntimeError):
    """A peer's state does not fit this rank (another recipe, model or mesh)."""


def _names(optim: Optimizer) -> list[str]:
    return [n for g in optim.param_groups for n in g.get("param_names", ())]


def _plain(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return local(value).detach()
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, where) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    raise LiveStateError(f"{where}: a {type(value).__name__} cannot travel in a heal (plain data and tensors only)")


def capture(optimizers: list[Optimizer]) -> list[dict[str, Any]]:
    """Every optimizer's live state on this rank, in container order. No collective, no copy."""
    out = []
    for i, optim in enumerate(optimizers):
        names = _names(optim)
        params = [p for g in optim.param_groups for p in g["params"]]
        state, dtensors = {}, {}
        for fqn, p in zip(names, params, strict=True):
            entries = optim.state.get(p, {})
            state[fqn] = {k: _plain(v, f"optimizer {i} {fqn} {k}") for k, v in entries.items()}
            dtensors[fqn] = {k: list(v.shape) for k, v in entries.items() if isinstance(v, DTensor)}
        entry = {
            "kind": type(optim).__name__,
            "params": names,
            "groups": [{k: _plain(v, f"optimizer {i} group {k}") for k, v in g.items() if k not in _NOT_VALUES}
                       for g in optim.param_groups],
            "state": state,
            "dtensor": dtensors,
        }
        if gx.is_gefenx_optimizer(optim):
            book = gx.codebook(optim)
            entry["codebook"] = None if book is None else book.detach()
            entry["global_step"] = gx.global_step(optim)
        out.append(entry)
    return out


def payload_bytes(value: Any) -> int:
    """Bytes of the tensors in a (nested) payload: what a heal moves."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    return 0


def _check(optimizers: list[Optimizer], peer: Any) -> str | None:
    if not isinstance(peer, list) or len(peer) != len(optimizers):
        return f"the peer has {len(peer) if isinstance(peer, list) else '?'} optimizers, this rank {len(optimizers)}"
    for i, (optim, entry) in enumerate(zip(optimizers, peer, strict=True)):
        if entry.get("kind") != type(optim).__name__:
            return f"optimizer {i} is {entry.get('kind')} on the peer and {type(optim).__name__} here"
        names = _names(optim)
        if entry.get("params") != names:
            return (f"optimizer {i} ({type(optim).__name__}) holds other parameters on the peer "
                    f"({len(entry.get('params') or [])} vs {len(names)}): another model or param grouping")
        groups = entry.get("groups") or []
        if len(groups) != len(optim.param_groups):
            return f"optimizer {i} has {len(groups)} param groups on the peer and {len(optim.param_groups)} here"
        for g, live in zip(groups, optim.param_groups, strict=True):
            missing = {k for k in live if k not in _NOT_VALUES} - set(g)
            if missing:
                return f"optimizer {i}: the peer's param group lacks {sorted(missing)}"
        params = [p for g in optim.param_groups for p in g["params"]]
        for fqn, p in zip(names, params, strict=True):
            for key, value in entry["state"].get(fqn, {}).items():
                mine = optim.state.get(p, {}).get(key)
                if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor):
                    if value.dtype != mine.dtype or tuple(value.shape) != tuple(local(mine).shape):
                        return (f"{fqn} {key}: the peer's is {value.dtype} {tuple(value.shape)}, this rank's "
                                f"{mine.dtype} {tuple(local(mine).shape)}: another layout or recipe")
                shape = entry["dtensor"].get(fqn, {}).get(key)
                if shape is not None and tuple(shape) != tuple(p.shape):
                    return f"{fqn} {key}: a sharded state of shape {tuple(shape)} for a parameter of {tuple(p.shape)}"
                if shape is not None and tuple(value.shape) != tuple(local(p).shape):
                    return (f"{fqn} {key}: the peer's shard is {tuple(value.shape)}, this rank's parameter shard "
                            f"{tuple(local(p).shape)}: the groups run on different meshes")
        if gx.is_gefenx_optimizer(optim) and "codebook" not in entry:
            return f"optimizer {i} ({type(optim).__name__}): the peer sent no codebook entry"
    return None


def _copy(value: Any, device: torch.device) -> Any:
    return value.to(device, copy=True) if isinstance(value, torch.Tensor) else value


def check(optimizers: list[Optimizer], peer: Any) -> str | None:
    """Why ``restore(optimizers, peer)`` would refuse ``peer``, or None: the same checks, nothing copied.
    A heal is checked when it arrives and installed only once every rank of the group has one
    (``ft.heal``), so a refusal must be known before any rank installs."""
    try:
        return _check(optimizers, peer)
    except (KeyError, TypeError, AttributeError) as e:
        return f"malformed optimizer state from the peer ({type(e).__name__}: {e})"


def restore(optimizers: list[Optimizer], peer: Any) -> None:
    """Make this rank's optimizers hold exactly ``peer`` (``capture`` on the same rank of
    another replica group). Checked first, then copied. No collective."""
    error = check(optimizers, peer)
    if error:
        raise LiveStateError(f"cannot heal the optimizer state from the live replica group: {error}")
    for optim, entry in zip(optimizers, peer, strict=True):
        params = [p for g in optim.param_groups for p in g["params"]]
        for fqn, p in zip(_names(optim), params, strict=True):
            dev = local(p).device
            shapes = entry["dtensor"].get(fqn, {})
            new = {}
            mine = optim.state.get(p, {})
            for key, value in entry["state"].get(fqn, {}).items():
                if isinstance(value, torch.Tensor):
                    # Where this rank keeps it; else a 0-dim counter stays on the host (torch's
                    # optimizers keep `step` there) and the rest goes to the parameter's device.
                    live = mine.get(key)
                    where = (local(live).device if isinstance(live, torch.Tensor)
                             else torch.device("cpu") if value.dim() == 0 else dev)
                    value = _copy(value, where)
                else:
                    value = copy.deepcopy(value)
                new[key] = like_param(p, value, tuple(shapes[key])) if key in shapes else value
            optim.state.pop(p, None)
            if new:
                optim.state[p] = new
        for g, values in zip(optim.param_groups, entry["groups"], strict=True):
            for k, v in values.items():
                live = g.get(k)
                g[k] = _copy(v, live.device if isinstance(live, torch.Tensor) else v.device) \
                    if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        if gx.is_gefenx_optimizer(optim):
            book = entry["codebook"]
            dev = next((local(p).device for p in params), torch.device("cpu"))
            gx.set_codebook(optim, None if book is None else book.to(dev, copy=True))
            gx.set_global_step(optim, int(entry["global_step"]))
