"""torchtitan's CheckpointManager, told the checkpoint's layout before a load.

Gefen's per-rank state differs in size, so the optimizer can only say what to
read once it has seen how the checkpoint was sharded. This subclass does one
thing: before torchtitan's ``dcp.load`` it reads the checkpoint metadata and
hands it to the optimizer container (``prepare_load``). Saving, async modes,
``load_step``, ``exclude_from_loading`` and ``initial_load_path`` are
torchtitan's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpointer.base import OPTIMIZER

__all__ = ["GefenCheckpointManager"]


class GefenCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        optimizers = self.states.get(OPTIMIZER)
        if from_hf or OPTIMIZER not in state_dict or not hasattr(optimizers, "prepare_load"):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(checkpoint_id).read_metadata()
        optimizers.prepare_load(checkpoint_id, metadata, prefix=f"{OPTIMIZER}.")
        try:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        finally:
            optimizers.abort_load()
