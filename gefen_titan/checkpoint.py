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

import contextlib
from dataclasses import dataclass
from typing import Any

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpointer.base import DATALOADER, OPTIMIZER

__all__ = ["GefenCheckpointManager"]


class GefenCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        with self._dataloader_prepared(state_dict, checkpoint_id, from_hf):
            self._dcp_load_optimizer_prepared(state_dict, checkpoint_id, from_hf, from_quantized)

    @contextlib.contextmanager
    def _dataloader_prepared(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool):
        """Data-loader hook (gefen_titan.dataloader): before ``dcp.load``, let a
        dataloader with ``prepare_load`` see which per-rank entries the
        checkpoint holds, so a rank resuming at another DP degree can read
        every source rank's entry; ``abort_load`` afterwards, also on failure."""
        dataloader = self.states.get(DATALOADER)
        if from_hf or DATALOADER not in state_dict or not hasattr(dataloader, "prepare_load"):
            yield
            return
        from torch.distributed.checkpoint import FileSystemReader

        dataloader.prepare_load(FileSystemReader(checkpoint_id).read_metadata(), prefix=f"{DATALOADER}.")
        try:
            yield
        finally:
            dataloader.abort_load()

    def _dcp_load_optimizer_prepared(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
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
