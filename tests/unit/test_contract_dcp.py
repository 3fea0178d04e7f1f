"""What gefen-titan's checkpoint storage takes from DCP's internals (torch is not pinned exactly).

``checkpoint/io/writing.py`` lays out data files with DCP's private
``_split_by_size_and_type``, ``DEFAULT_SUFFIX`` and ``_StorageInfo``;
``checkpoint/storage.load_all`` is DCP's ``dcp_to_torch_save`` through our
reader (``_load_state_dict``, ``_EmptyStateDictLoadPlanner``). If a torch
release changes any of them, these fail here, naming it, before a
checkpoint is written differently. The reader's agreement rides on DCP's
collectives (a local plan's ``storage_data`` reaching the coordinator's
``prepare_global_plan``; an exception there or in ``read_data`` raised on
every rank): ``tests/integration/test_checked_reads.py`` fails if either
changes.
"""

import dataclasses
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _split_by_size_and_type, _StorageInfo

from gefen_titan.checkpoint.format import schema, schema_records
from gefen_titan.checkpoint.io import storage
from gefen_titan.optim.kinds.gefen import keys as gefen_keys

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model.w": torch.randn(16, 8, generator=g), "step": torch.tensor(3),
            "optimizer." + schema.header_key(): schema_records.Header.for_blocking("agreed").to_json(),
            "optimizer." + gefen_keys.grid_key("w"): torch.rand(16, 2, 2, generator=g)}


def test_storage_info_and_split_signatures():
    assert DEFAULT_SUFFIX == ".distcp"
    assert [f.name for f in dataclasses.fields(_StorageInfo)] == [
        "relative_path", "offset", "length", "transform_descriptors"]
    assert _split_by_size_and_type(1, []) == [[]]


def test_our_files_are_named_as_dcp_names_them(tmp_path):
    dcp.save(state(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    dcp.save(state(), storage_writer=storage.storage_writer(tmp_path / "ours"), no_dist=True)
    data = lambda p: sorted(n for n in os.listdir(p) if n.endswith(DEFAULT_SUFFIX))  # noqa: E731
    assert data(tmp_path / "ours") == data(tmp_path / "dcp")
    md = storage.read_metadata(tmp_path / "ours")
    assert {i.fqn for i in md.storage_data} == set(state())


def test_load_all_returns_every_entry(tmp_path):
    want = state()
    dcp.save(want, storage_writer=storage.storage_writer(tmp_path / "c"), no_dist=True)
    got = storage.load_all(tmp_path / "c")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value


def test_default_load_planner_load_bytes_is_what_the_safe_reader_mirrors():
    """``checkpoint.io.item_reads.load_bytes`` does what ``DefaultLoadPlanner.load_bytes`` does with a byte
    entry, given a value unpickled with ``weights_only=True`` (DCP's would ``torch.load`` it unrestricted):
    if DCP changes where that value goes, the reader must change with it."""
    import inspect

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    src = inspect.getsource(DefaultLoadPlanner.load_bytes)
    assert "if self.flatten_state_dict:" in src
    assert "set_element(" in src and "self.original_state_dict" in src
    assert "self.mappings[read_item.dest_index.fqn]" in src
    assert "self.state_dict[read_item.dest_index.fqn]" in src
    assert src.count("torch.load(") == 2  # both branches unpickle: neither may be reached (the reader never calls it)


def test_the_safe_reader_never_calls_the_planners_load_bytes(tmp_path, monkeypatch):
    """Byte entries reach the planner's state dict without ``DefaultLoadPlanner.load_bytes`` (its torch.load),
    and a planner that reads bytes its own way is refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from gefen_titan.checkpoint.io import storage

    dcp.save({"a": {"n": 3, "s": "x"}, "t": torch.ones(2)}, storage_writer=storage.storage_writer(tmp_path / "c"),
             no_dist=True)

    class OwnBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise AssertionError("called")

    with pytest.raises(BaseException, match="reads byte entries itself"):
        dcp.load({"a": {"n": 0, "s": ""}}, storage_reader=storage.storage_reader(tmp_path / "c"),
                 planner=OwnBytes(), no_dist=True)

    def forbidden(*_a, **_k):
        raise AssertionError("DefaultLoadPlanner.load_bytes was called")

    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", forbidden)
    out = {"a": {"n": 0, "s": ""}, "t": torch.zeros(2)}
    dcp.load(out, storage_reader=storage.storage_reader(tmp_path / "c"), no_dist=True)
    assert out["a"] == {"n": 3, "s": "x"} and torch.equal(out["t"], torch.ones(2))


def test_a_stock_reader_has_no_registry_of_ours_to_join(tmp_path):
    """What docs/ckpt_tools.md says of DCP's storage extensions: the reader
    ``dcp.load(checkpoint_id=...)`` builds has a registry of its own with
    only zstd in it, v3 names no extension on its items, so the stock reader
    fails on a raw entry; the checked reader handed as ``storage_reader=``
    (the doc's Python path) reads it."""
    from torch.distributed.checkpoint._storage_utils import _storage_setup
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    want = state()
    path = tmp_path / "c"
    dcp.save(want, storage_writer=storage.storage_writer(path), no_dist=True)
    stock = _storage_setup(None, str(path), reader=True)
    assert type(stock) is FileSystemReader
    assert sorted(stock.transforms.extension_registry.extensions) == ["stream.zstd"]
    assert not any(info.transform_descriptors for info in storage.read_metadata(path).storage_data.values())

    grid = "optimizer." + gefen_keys.grid_key("w")
    with pytest.raises(CheckpointException, match="torch.load"):  # raw bytes are no torch.save frame
        dcp.load({grid: torch.zeros_like(want[grid])}, checkpoint_id=str(path), no_dist=True)
    out = {grid: torch.zeros_like(want[grid])}
    dcp.load(out, checkpoint_id=str(path), storage_reader=storage.storage_reader(path), no_dist=True)
    assert torch.equal(out[grid], want[grid])
