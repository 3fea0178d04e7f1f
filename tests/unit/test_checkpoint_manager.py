"""GefenCheckpointManager's seams: every LoadPreparer it holds sees the
checkpoint's metadata before DCP reads (whatever its key: the optimizer, the
data loader, or a component of the user's), every SnapshotsOnSave is told
whether saves are asynchronous, and ``dcp.load`` is called as torchtitan
calls it, with one checking reader per load. One process, no process group."""

from __future__ import annotations

import os
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.io import reading
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


def _save_step(folder: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        _manager(folder, Planned()).save(curr_step=1)


def test_dcp_load_is_called_as_torchtitan_calls_it_with_one_checking_reader(tmp_path):
    """torchtitan's manager calls ``dcp.load(state_dict, checkpoint_id=...)``; ours makes the same call plus
    its checking reader, which reads ``.metadata`` once for the LoadPreparer and for DCP alike."""
    folder = str(tmp_path / "ckpt")
    _save_step(folder)
    loader = Planned()
    with mock.patch.object(dcp, "load", wraps=dcp.load) as load, \
         mock.patch.object(reading, "read_and_check_metadata", wraps=reading.read_and_check_metadata) as read, \
         warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        assert _manager(folder, loader).load(step=1)
    load.assert_called_once()
    (state_dict,), kwargs = load.call_args
    assert kwargs["checkpoint_id"] == os.path.join(folder, "step-1")
    assert isinstance(kwargs["storage_reader"], reading.CheckedFileSystemReader)
    assert {"weight", "bias", "extra"} <= set(state_dict)
    assert read.call_count == 1  # one checked read of .metadata per load
    assert ("load", [0.0, 1.0, 2.0, 3.0]) in loader.calls


def test_without_a_load_preparer_nothing_reads_before_dcp_load(tmp_path):
    """torchtitan's own tests mock ``dcp.load`` over folders whose ``.metadata`` is empty: with no component
    that plans from the metadata, the first read is DCP's, inside ``dcp.load``."""
    step = tmp_path / "ckpt" / "step-5"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    cfg = GefenCheckpointManager.Config(enable=True, folder=str(tmp_path / "ckpt"), interval=1, keep_latest_k=0,
                                        last_save_model_only=False)
    mgr = cfg.build(dataloader=Blob(), model_parts=[torch.nn.Linear(2, 2)], optimizers=Blob(),
                    lr_schedulers=Blob(), states={}, sd_adapter=None, base_folder="")
    with mock.patch.object(dcp, "load") as load:
        assert mgr.load(step=-1)
    load.assert_called_once()
    assert load.call_args.kwargs["checkpoint_id"] == str(step)


@pytest.mark.parametrize("preparer", [True, False], ids=["before-dcp.load", "inside-dcp.load"])
def test_a_refused_metadata_says_the_same_wherever_it_is_first_read(tmp_path, preparer):
    """Read by the manager for a LoadPreparer, or first by DCP (which swallows ``read_metadata``'s errors):
    the same refusal, naming the file, and nothing reaches the live model."""
    folder = str(tmp_path / "ckpt")
    _save_step(folder)
    (tmp_path / "ckpt" / "step-1" / ".metadata").write_bytes(b"")
    cfg = GefenCheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0,
                                        last_save_model_only=False)
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    mgr = cfg.build(dataloader=Blob(), model_parts=[model], optimizers=Blob(), lr_schedulers=Blob(),
                    states={"extra": Planned()} if preparer else {}, sd_adapter=None, base_folder="")
    with warnings.catch_warnings(), pytest.raises(
            GefenCheckpointError, match=r"^the checkpoint cannot be loaded: checkpoint .*step-1 is corrupt: "
                                        r"\.metadata: 0 bytes, the save wrote"):
        warnings.filterwarnings("ignore", message=".*single process.*")
        mgr.load(step=1)
    assert torch.equal(model.weight, before)


def test_the_save_and_load_lines_name_step_folder_bytes_and_ranks(tmp_path, caplog):
    """torchtitan's own lines ("Saving the checkpoint.") name neither the step nor the folder."""
    folder = str(tmp_path / "ckpt")
    with warnings.catch_warnings(), caplog.at_level("INFO"):
        warnings.filterwarnings("ignore", message=".*single process.*")
        _manager(folder, Planned()).save(curr_step=3)
        assert _manager(folder, Planned()).load(step=3)
    step = os.path.join(folder, "step-3")
    size = sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step))
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"Saved step 3 to {step}: {size / 1e6:.1f} MB in ") and m.endswith(" s") for m in lines), \
        lines
    assert f"Loading step 3 from {step}: saved by 1 rank, loading onto 1 rank" in lines, lines
