"""GefenCheckpointManager's seams: every LoadPreparer it holds sees the
checkpoint's metadata before DCP reads (whatever its key: the optimizer, the
data loader, or a component of the user's), and every SnapshotsOnSave is told
whether saves are asynchronous. One process, no process group."""

from __future__ import annotations

import warnings

import pytest
import torch

from gefen_titan.checkpoint.manager import GefenCheckpointManager, LoadPreparer, SnapshotsOnSave
from tests.helpers.loader_checkpoint import Blob


class Planned:
    """A component that plans its load from the metadata and saves views."""

    def __init__(self) -> None:
        self.calls: list = []
        self.value = torch.arange(4.0)
        self.snapshot_on_save = True

    def state_dict(self):
        return {"v": self.value}

    def load_state_dict(self, sd):
        self.calls.append(("load", sd["v"].tolist()))

    def prepare_load(self, checkpoint_id, metadata, prefix):
        self.calls.append(("prepare", prefix, sorted(k for k in metadata.state_dict_metadata if k.startswith(prefix))))

    def abort_load(self):
        self.calls.append(("abort",))


def _manager(folder: str, extra: Planned) -> GefenCheckpointManager:
    cfg = GefenCheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0,
                                        last_save_model_only=False)
    return cfg.build(dataloader=Blob(), model_parts=[torch.nn.Linear(2, 2)], optimizers=Blob(), lr_schedulers=Blob(),
                     states={"extra": extra}, sd_adapter=None, base_folder="")


def test_every_load_preparer_is_prepared_and_released(tmp_path):
    assert isinstance(Planned(), LoadPreparer) and isinstance(Planned(), SnapshotsOnSave)
    assert not isinstance(Blob(), LoadPreparer)
    saver = Planned()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        mgr = _manager(str(tmp_path / "ckpt"), saver)
        assert saver.snapshot_on_save is False  # async_mode "disabled": views are safe
        mgr.save(curr_step=1)
        loader = Planned()
        assert _manager(str(tmp_path / "ckpt"), loader).load(step=1)
    assert loader.calls == [("prepare", "extra.", ["extra.v"]), ("load", [0.0, 1.0, 2.0, 3.0]), ("abort",)]


def test_a_failed_load_still_releases_the_plan(tmp_path):
    class Refuses(Planned):
        def prepare_load(self, checkpoint_id, metadata, prefix):
            super().prepare_load(checkpoint_id, metadata, prefix)
            raise ValueError("not this checkpoint")

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        _manager(str(tmp_path / "ckpt"), Planned()).save(curr_step=1)
        refuses = Refuses()
        with pytest.raises(ValueError, match="not this checkpoint"):
            _manager(str(tmp_path / "ckpt"), refuses).load(step=1)
    assert refuses.calls[-1] == ("abort",) and not any(c[0] == "load" for c in refuses.calls)


def test_a_raw_tensor_in_states_is_restored(tmp_path):
    """torchtitan loads a plain tensor in ``states`` in place; the manager reads into fresh targets, so it
    must apply it after the load as it applies the model (torchtitan's own tests pass one)."""
    def build(value: float):
        cfg = GefenCheckpointManager.Config(enable=True, folder=str(tmp_path / "ckpt"), interval=1, keep_latest_k=0,
                                            last_save_model_only=False)
        t = torch.full((2,), value)
        return cfg.build(dataloader=Blob(), model_parts=[torch.nn.Linear(2, 2)], optimizers=Blob(),
                         lr_schedulers=Blob(), states={"trainer": t}, sd_adapter=None, base_folder=""), t

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        saver, _ = build(5.0)
        saver.save(curr_step=1)
        loader, live = build(-7.0)
        assert loader.load(step=1)
    assert torch.equal(live, torch.full((2,), 5.0))
