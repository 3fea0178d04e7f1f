"""``GefenFTOptimizersContainer``: gefen-titan's optimizer container under torchft.

torchtitan's ``TorchFTOptimizersContainer`` wraps the stock container, runs
``init_optim_state`` (a zero-gradient step, from which Gefen would learn a
codebook and periods of zeros) and serves a state dict cached once at
start-up to every joining group (torchtitan #4422). This one wraps
``GefenOptimizersContainer`` and does neither:

- ``zero_grad`` starts torchft's quorum (synchronous: ``ft.manager``; a
  heal arrives before it returns) between the ``quorum_listeners``'
  ``before_quorum`` and ``after_quorum`` (``ft.heal.HealState``, which
  installs a heal on every rank of the group or on none), then tells the
  ``on_step_start`` listeners (the trainer snapshots what an uncommitted
  step must rewind, the healed state included);
- ``step`` asks torchft ``should_commit`` and steps only then, keeping the
  verdict in ``last_step_committed`` (the trainer and the checkpoint manager
  read it); the step hooks (the first step's agreement, the empty-shard
  counters) run only around a committed step;
- ``heal_state_dict`` captures the live state on every call (no cache, no
  collective; ``optim.live_state``) plus whether the first step's agreement
  has still to run; ``load_heal_state_dict`` restores both, so a group that
  joins after step 1 keeps its peers' periods and codebook and never agrees
  again on its own gradients.

Checkpoints (``state_dict`` / ``load_state_dict``) are the parent's, format
and all. With ``fault_tolerance.enable = false`` it is the parent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.optim import Optimizer
from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

from gefen_titan.optim import live_state
from gefen_titan.optim.container import GefenOptimizersContainer

__all__ = ["GefenFTOptimizersContainer", "QuorumListener"]


@runtime_checkable
class QuorumListener(Protocol):
    """Called on every rank of the group around each step's torchft quorum (``ft.heal.HealState``)."""

    def before_quorum(self) -> None: ...

    def after_quorum(self) -> None: ...


def _own_step() -> Callable[..., Any]:
    # torch may already have put its hook wrapper around the parent's step in place (a plain
    # container built earlier in this process): take the function below it.
    step = GefenOptimizersContainer.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


# The container's own step with torch's hooks around it.
_STEP_WITH_HOOKS = Optimizer.profile_hook_step(_own_step())


class GefenFTOptimizersContainer(GefenOptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(GefenOptimizersContainer.Config, TorchFTOptimizersContainer.Config):
        """``GefenOptimizersContainer.Config``; being a ``TorchFTOptimizersContainer.Config``
        too is how torchtitan's FT trainer knows to hand it the torchft manager."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module], ft_manager: Any = None) -> None:
        super().__init__(config, model_parts=model_parts)
        self._manager = ft_manager.manager if ft_manager is not None and ft_manager.enabled else None
        self.last_step_committed = True
        self.on_step_start: list[Callable[[], None]] = []
        self.quorum_listeners: list[QuorumListener] = []

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._manager is not None:
            for listener in self.quorum_listeners:
                listener.before_quorum()
            self._manager.start_quorum()
            for listener in self.quorum_listeners:
                listener.after_quorum()
        super().zero_grad(*args, **kwargs)
        for listener in self.on_step_start:
            listener()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._manager is not None:
            self.last_step_committed = bool(self._manager.should_commit())
        if self.last_step_committed:
            _STEP_WITH_HOOKS(self, *args, **kwargs)

    # torch runs an optimizer's step hooks in a wrapper it puts, once, around the most derived
    # class's `step` (Optimizer._patch_step_function). Around this `step` they would run also
    # for a step torchft does not commit: the agreement would learn periods and a codebook from
    # a step that is then retried (its gradients possibly garbage from a failed all-reduce), and
    # the empty-shard counters would count it. So this one is marked wrapped, and the hooks run
    # around the parent's step, only when it runs.
    step.hooked = True  # type: ignore[attr-defined]

    def heal_state_dict(self) -> dict[str, Any]:
        return {
            "optimizers": live_state.capture(self.optimizers),
            "agreement_needed": None if self.agreement is None else bool(self.agreement.needed),
        }

    def check_heal_state_dict(self, state_dict: Any) -> str | None:
        """Why ``load_heal_state_dict`` would refuse ``state_dict``, or None (nothing changed)."""
        if not isinstance(state_dict, dict) or "optimizers" not in state_dict:
            return "malformed optimizer state from the peer"
        if (state_dict.get("agreement_needed") is None) != (self.agreement is None):
            return "it runs another optimizer.blocking than this one"
        return live_state.check(self.optimizers, state_dict["optimizers"])

    def load_heal_state_dict(self, state_dict: dict[str, Any]) -> None:
        error = self.check_heal_state_dict(state_dict)
        if error:
            raise live_state.LiveStateError(
                f"cannot heal the optimizer state from the live replica group: {error}")
        live_state.restore(self.optimizers, state_dict["optimizers"])
        if self.agreement is not None:
            self.agreement.needed = bool(state_dict["agreement_needed"])
