"""A checkpoint manager for the committed format-v2 fixture (tests/fixtures/).

The fixture guards the checkpoint format: a v2 checkpoint written by the
trainer at 2 ranks must keep loading bit-exactly at other sizes, whatever
the code around it becomes. Its model weights are torchtitan's entries, not
ours, and are 23.5 MiB of fp32 for the debug model against 6.5 MiB of
optimizer state, so the fixture leaves them out: this manager saves and
loads every component but the model. Everything else (the optimizer
container's entries, the data loader, the LR scheduler, the train state) is
written and read by ``GefenCheckpointManager`` as in any run; after a load,
the validation hook's dump (``DumpingCheckpointManager``) writes the loaded
global state so a test can compare it with the fixture's files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.checkpointer.base import MODEL
from torchtitan.config import override
from torchtitan.config.override import derive

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.validation.hooks import DumpingCheckpointManager


class ModelFreeCheckpointManager(DumpingCheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(DumpingCheckpointManager.Config):
        pass

    def _flattened_model_states_sd(self, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
        # torchtitan flattens the model's entries into every save and load
        # here (and refuses "model" in exclude_from_loading): leave them out.
        states = state_dict if state_dict is not None else self.states
        return {k: v for k, v in states.items() if k != MODEL}


@override(target=GefenCheckpointManager.Config, exact=True,
          description="tests: checkpoints without the model, dumps after loads")
def without_model(cfg: GefenCheckpointManager.Config, *, dir: str, save_steps: list[int] | None = None):
    return derive(cfg, ModelFreeCheckpointManager.Config, dump_dir=dir, dump_save_steps=list(save_steps or []))
