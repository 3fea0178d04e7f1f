"""torchtitan's CheckpointManager, told the checkpoint's layout before a load.

Components whose state depends on how the checkpoint was written (Gefen's
records, the elastic data loader's per-rank entries) must see the checkpoint
metadata before DCP asks them for load destinations. This subclass does one
thing: before torchtitan's ``dcp.load`` it reads the metadata and hands it to
every component that implements ``LoadPreparer`` (the optimizer container,
``gefen_titan.data.elastic``), and after the load (or its failure) calls their
``abort_load``. Saving, async modes, ``load_step``, ``exclude_from_loading``
and ``initial_load_path`` are torchtitan's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpointer.base import DATALOADER, OPTIMIZER

from gefen_titan.checkpoint.errors import unreadable
from gefen_titan.checkpoint.storage import read_metadata

__all__ = ["GefenCheckpointManager", "LoadPreparer"]


@runtime_checkable
class LoadPreparer(Protocol):
    """A checkpointed component that plans its load from the checkpoint's metadata.

    ``prepare_load`` runs on every rank before ``dcp.load`` (it may run small
    collective reads of its own and must raise the same error on every rank);
    after it, the component's ``state_dict()`` returns the load destinations.
    ``abort_load`` runs after the load, successful or not, and drops the plan.
    """

    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str) -> None: ...

    def abort_load(self) -> None: ...


class GefenCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        # A disabled manager returns from __init__ before it keeps any states.
        optimizer = getattr(self, "states", {}).get(OPTIMIZER)
        if optimizer is not None and hasattr(type(optimizer), "snapshot_on_save"):
            # Async saves write after later steps mutate Gefen's state in
            # place: its entries must be copies, not views.
            optimizer.snapshot_on_save = str(config.async_mode) != "disabled"

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        prepared = [
            (self.states[key], key)
            for key in (OPTIMIZER, DATALOADER)
            if not from_hf and key in state_dict and isinstance(self.states.get(key), LoadPreparer)
        ]
        if not prepared:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        try:
            metadata = read_metadata(checkpoint_id)
        except (OSError, CheckpointException) as e:
            raise unreadable(checkpoint_id, e) from e
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
