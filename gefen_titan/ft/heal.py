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
``load_state_dict``, because torchft calls it on a rank only when that
rank's transfer succeeded, and picks each rank's source on its own: when
the serving peer dies mid-transfer, one rank of a joining group may hold a
whole heal (from another group) while another's stream was cut (seen in a
3-group run: the group's ranks then held different states and ran the
first step's agreement on one rank only). So a heal is installed on every
rank of the group or on none:

- ``load_state_dict`` only checks what arrived (model, optimizer) and
  stages it;
- ``after_quorum``, called on every rank of the group after each quorum
  (``GefenFTOptimizersContainer.zero_grad``), agrees over the group's own
  process group (one scalar all-reduce a step): a
  refusal raises on every rank; a rank whose transfer failed (torchft
  reported it: ``Manager.errored``) makes every rank discard what it staged
  and put torchft's step back where ``before_quorum`` found it, so the step
  is not committed (torchft's ``should_commit`` agrees on the failure) and
  the next quorum heals the whole group again; otherwise each rank that
  staged a heal installs it.

A refusal therefore stops the group on all its ranks together; the live
groups never see it. At install the schedulers load before the optimizer,
whose param groups then carry the peer's LR exactly (torchtitan #4598: a
stale LR after a heal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torchtitan.tools.logging import logger

from gefen_titan.distributed import local, max_over_ranks, raise_on_any_rank
from gefen_titan.optim.live_state import LiveStateError, payload_bytes

__all__ = ["HealState", "HealStats", "Heals", "TorchFTManager"]


@runtime_checkable
class Heals(Protocol):
    """An optimizer container whose live state a torchft heal can carry, and which says
    whether torchft committed its last step (``GefenFTOptimizersContainer``)."""

    last_step_committed: bool
    quorum_listeners: list[Any]  # called around each quorum (``HealState`` is one)

    def heal_state_dict(self) -> dict[str, Any]: ...

    def check_heal_state_dict(self, state_dict: Any) -> str | None: ...

    def load_heal_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class TorchFTManager(Protocol):
    """What the heal asks of torchft's ``Manager``: whether this rank's quorum failed (its transfer
    among others), and its step, to put back when a heal is discarded."""

    def errored(self) -> Any: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state_dict: dict[str, int]) -> None: ...


@dataclass
class HealStats:
    """What the last heal moved and cost on this rank (its log line, which ``scripts/bench_heal.py`` reads)."""

    heals: int = 0
    model_bytes: int = 0
    optimizer_bytes: int = 0
    params: int = 0
    load_seconds: float = 0.0
    receive_seconds: float = 0.0


# after_quorum's verdict, worst last.
_FINE, _FAILED, _REFUSED = 0, 1, 2


def _model_tensors(model_parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for fqn, t in [*part.named_parameters(), *part.named_buffers()]:
            out[fqn] = t
    return out


class HealState:
    """The state torchft moves to a joining replica group (registered by ``GefenFTCheckpointManager``)."""

    def __init__(self, *, model_parts: list[torch.nn.Module], optimizers: Heals, lr_schedulers: Any,
                 dataloader: Any, train_state: Any, manager: TorchFTManager, transport: Any = None) -> None:
        if not isinstance(optimizers, Heals):
            raise TypeError(
                f"fault tolerance needs gefen-titan's GefenFTOptimizersContainer, got {type(optimizers).__name__}: "
                "build the run from a recipe with a [fault_tolerance] section")
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.train_state = train_state
        self.manager = manager
        self.transport = transport  # ft.transport.SafeHTTPTransport: what the transfer took, for the log
        self.stats = HealStats()
        self._staged: dict[str, Any] | None = None  # a heal this rank received and checked, not installed
        self._refusal: str | None = None
        self._manager_before: dict[str, int] | None = None

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

    def _check(self, state_dict: Any) -> str | None:
        try:
            return self._check_model(state_dict["model"]) or self.optimizers.check_heal_state_dict(
                state_dict["optimizer"])
        except (KeyError, TypeError) as e:
            return f"malformed heal payload ({type(e).__name__}: {e})"

    def before_quorum(self) -> None:
        """Every rank, before the step's quorum: torchft's step as it is (a discarded heal puts it back)."""
        self._staged, self._refusal = None, None
        self._manager_before = dict(self.manager.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torchft hands this rank the heal it received: check it and stage it; ``after_quorum`` installs it."""
        self._refusal = self._check(state_dict)
        self._staged = state_dict if self._refusal is None else None

    def after_quorum(self) -> None:
        """Every rank of the group, after the step's quorum: install the staged heals on all ranks or none.

        Collective over the group's process group (the module docstring says why and what it costs).
        """
        staged, self._staged = self._staged, None
        failed = self.manager.errored()
        worst = max_over_ranks(_REFUSED if self._refusal else _FAILED if failed is not None else _FINE)
        if worst == _REFUSED:  # on every rank: the ranks without a refusal join with None
            raise_on_any_rank(self._refusal, "cannot heal from the live replica group", LiveStateError)
        if worst == _FAILED:
            if staged is not None:
                # torchft set its step to the heal's when this rank received it: back to where the
                # group is, so that the next quorum heals every rank of it again.
                self.manager.load_state_dict(self._manager_before)
                logger.warning(
                    f"Discarded the heal for step {staged['train_state'].get('step')} this rank received: "
                    "another rank of this replica group failed in the same quorum"
                    f"{f' (here: {failed})' if failed is not None else ''}, so no rank installs its heal; the "
                    "step is not committed and the next quorum heals the group again")
            return
        if staged is not None:
            self._install(staged)

    def _install(self, state_dict: dict[str, Any]) -> None:
        begin = time.perf_counter()
        # Checked when it arrived (``load_state_dict``). The data loader checks its position's
        # identity. The schedulers come before the optimizer's param groups, which then hold
        # the peer's LR whatever the schedulers computed.
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
