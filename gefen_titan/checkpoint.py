"""torchtitan's CheckpointManager, told the checkpoint's layout before a load.

Gefen's per-rank state differs in size, so the optimizer can only say what to
read once it has seen how the checkpoint was sharded. This subclass does one
thing: before torchtitan's ``dcp.load`` it reads the checkpoint metadata and
hands it to the optimizer container (``prepare_load``), and likewise to the
data loader when it has ``prepare_load`` (``gefen_titan.dataloader``: a resume
at another data-parallel degree reads every source rank's loader state).
Saving, async modes, ``load_step``, ``exclude_from_loading`` and
``initial_load_path`` are torchtitan's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.checkpoint import CheckpointManager
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpointer.base import DATALOADER, OPTIMIZER

from .reshard.adapter import unreadable

__all__ = ["GefenCheckpointManager"]


class GefenCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        # Components that must see the checkpoint's layout before DCP asks
        # them for load destinations: the optimizer container (Gefen's
        # per-rank state) and the elastic data loader (every source rank's
        # entry when the data-parallel degree changed).
        prepared = [
            (self.states[key], key)
            for key in (OPTIMIZER, DATALOADER)
            if not from_hf and key in state_dict and hasattr(self.states.get(key), "prepare_load")
        ]
        if not prepared:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(checkpoint_id).read_metadata()
        try:
            for component, key in prepared:
                component.prepare_load(checkpoint_id, metadata, prefix=f"{key}.")
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        except (CheckpointException, OSError) as e:
            # A read failure: DCP raises the same CheckpointException on every rank.
            raise unreadable(checkpoint_id, e) from e
        finally:
            for component, _ in prepared:
                component.abort_load()
