"""``GefenFTCheckpointManager``: gefen-titan's checkpoint manager under torchft.

torchtitan's ``TorchFTCheckpointManager`` hands torchft closures over the
*checkpoint* state dicts (which for gefen-titan's optimizer run collectives,
torchft #343, and for torchtitan's FT optimizer are a cached snapshot,
torchtitan #4422), and only when ``checkpoint.enable`` is set. This one:

- registers ``ft.heal.HealState`` with torchft whether or not persistent
  checkpoints are on: a heal needs no checkpoint;
- writes persistent checkpoints in gefen-titan's format (format v3,
  reshardable, ``.digests``) from the replica group torchft ranks first
  (``participating_rank() == 0``) only, as torchtitan does; a run without
  torchft resumes them at any size, like any other;
- writes nothing for a step torchft did not commit (the trainer retries that
  step), so no folder is ever written twice for one step number;
- purges old checkpoints from that group only;
- hands ``checkpoint.digest_key_env``'s key to the heal transport, which
  then signs and checks every heal (``ft.transport``).

The per-replica data loader checkpoints of torchtitan's manager are not
needed: the global-order loader's position is global, in every persistent
checkpoint and in every heal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.tools.logging import logger

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.ft.heal import HealState

__all__ = ["GefenFTCheckpointManager", "HEAL_KEY"]

HEAL_KEY = "gefen_titan"  # the key of gefen-titan's state in torchft's heal payload


class GefenFTCheckpointManager(GefenCheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(GefenCheckpointManager.Config):
        """``GefenCheckpointManager.Config``; the replica group that writes is torchft's choice."""

    def __init__(self, config: Config, *, ft_manager: Any = None, **kwargs: Any) -> None:
        self.ft_manager = ft_manager.manager if ft_manager is not None and ft_manager.enabled else None
        self.heal: HealState | None = None  # before super(): its save may ask whether to write
        super().__init__(config, **kwargs)
        if self.ft_manager is None:
            return
        self.heal = HealState(
            model_parts=kwargs["model_parts"], optimizers=kwargs["optimizers"], lr_schedulers=kwargs["lr_schedulers"],
            dataloader=kwargs.get("dataloader"), train_state=kwargs["states"]["train_state"],
            manager=self.ft_manager, transport=ft_manager.transport)
        self.ft_manager.register_state_dict_fn(HEAL_KEY, self.heal.load_state_dict, self.heal.state_dict)
        # torchft hands each rank its heal on its own; the container's quorum calls this around each
        # quorum, where every rank of the group installs its heal or none does (ft.heal).
        self.heal.optimizers.quorum_listeners.append(self.heal)
        # With checkpoint.digest_key_env, heals are signed and checked with the checkpoints' key.
        ft_manager.transport.key = self._digest_key

    def _writes(self) -> bool:
        if self.ft_manager is None:
            return True
        return self.ft_manager.participating_rank() == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.heal is not None and not self.heal.optimizers.last_step_committed:
            return False  # the trainer retries this step; its number is saved once it commits
        if not self._writes():
            if self._should_save(curr_step, last_step):
                logger.info(f"Replica group {self.ft_manager.participating_rank()} does not write step {curr_step}; "
                            "the first participating group does")
            return False
        return super()._save(curr_step, last_step)

    def _should_purge(self) -> bool:
        return super()._should_purge() and self._writes()
