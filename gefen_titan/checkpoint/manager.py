"""torchtitan's CheckpointManager, told the checkpoint's layout before a load.

Components whose state depends on how the checkpoint was written (Gefen's
records, the elastic data loader's per-rank entries) must see the checkpoint
metadata before DCP asks them for load destinations. This subclass does one
thing: before torchtitan's ``dcp.load`` it reads the metadata and hands it to
every component that is a ``LoadPreparer`` (the optimizer container, the
elastic data loader), and after the load (or its failure) calls their
``abort_load``. It also tells every component that saves views of live
tensors (``SnapshotsOnSave``) whether saves are asynchronous. Saving, async
modes, ``load_step``, ``exclude_from_loading`` and ``initial_load_path`` are
torchtitan's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import CheckpointManager

from gefen_titan.checkpoint.errors import unreadable
from gefen_titan.checkpoint.storage import read_metadata

__all__ = ["GefenCheckpointManager", "LoadPreparer", "SnapshotsOnSave"]


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


@runtime_checkable
class SnapshotsOnSave(Protocol):
    """A checkpointed component whose ``state_dict()`` hands DCP views of live tensors.

    An async save writes after later steps have changed those tensors in
    place, so under ``checkpoint.async_mode`` other than ``"disabled"`` the
    manager sets ``snapshot_on_save`` and the component hands copies instead.
    """

    snapshot_on_save: bool


class GefenCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:  # torchtitan keeps no states then
            return
        for component in self.states.values():
            if isinstance(component, SnapshotsOnSave):
                component.snapshot_on_save = str(config.async_mode) != "disabled"

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        # Every rank holds the same components in the same order, so every
        # rank prepares them in the same order (their reads are collective).
        prepared = [
            (component, key)
            for key, component in self.states.items()
            if not from_hf and key in state_dict and isinstance(component, LoadPreparer)
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
