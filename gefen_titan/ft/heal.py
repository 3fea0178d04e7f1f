"""What a rejoining replica group takes from a live one: the heal payload.

torchft calls ``HealState.state_dict`` on the live group (on its quorum
thread, while the main thread waits in the synchronous quorum) and
``HealState.load_state_dict`` on the joiner (on its main thread, inside
``zero_grad``, before the step draws a batch). Rank ``r`` of the joiner
receives what rank ``r`` of the peer captured; both run the same recipe on
the same mesh, so every piece is this rank's shard, copied as it is:

- ``model``: every parameter's and buffer's local shard;
- ``optimizer``: ``GefenFTOptimizersContainer.heal_state_dict`` (every
  optimizer's per-parameter state verbatim, the param groups' values with
  the LR the scheduler set, Gefen's codebook and global step, whether the
  agreement has still to run);
- ``lr_scheduler``, ``dataloader``, ``train_state``: their own state dicts.
  The data position is the global-order loader's one global position (the
  recipe layer refuses another loader under fault tolerance), so the joiner
  reads its own slice of the very batch its peers read next.

``state_dict`` builds the payload afresh on every call (never a cache:
torchtitan #4422) and runs no collective (torchft #343). Nor does
``load_state_dict``: torchft heals each rank on its own (at the step-0 sync
rank 0 of a group may load from another group while rank 1 of the same
group serves that group). It checks the model's and the optimizer's pieces
before it copies them; a refusal raises on that rank, torchrun stops its
group, and the live groups never see it. The schedulers load
before the optimizer, whose param groups then carry the peer's LR exactly
(torchtitan #4598: a stale LR after a heal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torchtitan.tools.logging import logger

from gefen_titan.distributed import local
from gefen_titan.optim.live_state import LiveStateError, payload_bytes

__all__ = ["HealState", "HealStats", "Heals"]


@runtime_checkable
class Heals(Protocol):
    """An optimizer container whose live state a torchft heal can carry, and which says
    whether torchft committed its last step (``GefenFTOptimizersContainer``)."""

    last_step_committed: bool

    def heal_state_dict(self) -> dict[str, Any]: ...

    def load_heal_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class HealStats:
    """What the last heal moved and cost on this rank (its log line, which ``scripts/bench_heal.py`` reads)."""

    heals: int = 0
    model_bytes: int = 0
    optimizer_bytes: int = 0
    params: int = 0
    load_seconds: float = 0.0
    receive_seconds: float = 0.0


def _model_tensors(model_parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for fqn, t in [*part.named_parameters(), *part.named_buffers()]:
            out[fqn] = t
    return out


class HealState:
    """The state torchft moves to a joining replica group (registered by ``GefenFTCheckpointManager``)."""

    def __init__(self, *, model_parts: list[torch.nn.Module], optimizers: Heals, lr_schedulers: Any,
                 dataloader: Any, train_state: Any, transport: Any = None) -> None:
        if not isinstance(optimizers, Heals):
            raise TypeError(
                f"fault tolerance needs gefen-titan's GefenFTOptimizersContainer, got {type(optimizers).__name__}: "
                "build the run from a recipe with a [fault_tolerance] section")
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.train_state = train_state
        self.transport = transport  # ft.transport.SafeHTTPTransport: what the transfer took, for the log
        self.stats = HealStats()

    def state_dict(self) -> dict[str, Any]:
        """This rank's live state as plain tensors and data. No collective, no copy."""
        return {
            "model": {fqn: local(t).detach() for fqn, t in _model_tensors(self.model_parts).items()},
            "optimizer": self.optimizers.heal_state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "dataloader": self.dataloader.state_dict() if self.dataloader is not None else {},
            "train_state": self.train_state.state_dict(),
        }

    def _check_model(self, peer: Any) -> str | None:
        mine = _model_tensors(self.model_parts)
        if not isinstance(peer, dict) or set(peer) != set(mine):
            extra = sorted(set(peer) - set(mine))[:3] if isinstance(peer, dict) else []
            lacking = sorted(set(mine) - set(peer))[:3] if isinstance(peer, dict) else []
            return f"the peer's model has other tensors (extra {extra}, lacking {lacking}): another model"
        for fqn, t in mine.items():
            v, here = peer[fqn], local(t)
            if not isinstance(v, torch.Tensor) or v.dtype != here.dtype or v.shape != here.shape:
                return (f"{fqn}: the peer's shard is {getattr(v, 'dtype', type(v).__name__)} "
                        f"{tuple(getattr(v, 'shape', ()))}, this rank's {here.dtype} {tuple(here.shape)}: "
                        "the groups run on different meshes or models")
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        begin = time.perf_counter()
        try:
            error = self._check_model(state_dict["model"])
        except (KeyError, TypeError) as e:
            error = f"malformed heal payload ({type(e).__name__}: {e})"
        if error:
            raise LiveStateError(f"cannot heal from the live replica group: {error}")
        # The optimizer checks all of its state before it copies any; the data
        # loader checks its position's identity. The schedulers come before the optimizer's
        # param groups, which then hold the peer's LR whatever the schedulers computed.
        if self.dataloader is not None:
            self.dataloader.load_state_dict(state_dict["dataloader"])
        self.lr_schedulers.load_state_dict(state_dict["lr_scheduler"])
        self.optimizers.load_heal_state_dict(state_dict["optimizer"])
        self.train_state.load_state_dict(state_dict["train_state"])
        with torch.no_grad():
            for fqn, t in _model_tensors(self.model_parts).items():
                local(t).copy_(state_dict["model"][fqn])
        s = self.stats
        s.heals += 1
        s.model_bytes = payload_bytes(state_dict["model"])
        s.optimizer_bytes = payload_bytes(state_dict["optimizer"])
        s.params = sum(local(p).numel() for part in self.model_parts for p in part.parameters())
        s.load_seconds = time.perf_counter() - begin
        s.receive_seconds = self.transport.last_receive_seconds if self.transport is not None else 0.0
        logger.info(
            f"Healed from the live replica group at step {self.train_state.step}: model "
            f"{s.model_bytes / 2**20:.2f} MiB, optimizer {s.optimizer_bytes / 2**20:.2f} MiB "
            f"({s.optimizer_bytes / max(s.params, 1):.3f} B/param) for {s.params} param elements on this rank; "
            f"received in {s.receive_seconds * 1e3:.1f} ms, loaded in {s.load_seconds * 1e3:.1f} ms")
