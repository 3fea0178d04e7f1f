"""Format v3's raw entries: written without torch.save's framing, read back bit for bit.

One process, DCP with ``no_dist=True``, the writer and reader of
``checkpoint.io.storage`` on a state dict that mixes raw entries (Gefen state
keys) with ordinary ones (a model weight, a record, a counter). The
multi-rank saves and reshards of real state are
tests/integration/test_agreed_blocking.py and test_v2_fixture.py.
"""

import os
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gefen_titan.checkpoint.format import digests, schema, schema_records
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.optim.kinds.gefen_muon import keys as muon_keys

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

CODES = "optimizer." + gefen_keys.qcodes_key("layers.0.w")
GRID = "optimizer." + gefen_keys.grid_key("layers.0.w")
EMPTY = "optimizer." + gefen_keys.grid_key("layers.1.w")
GROUP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def state(empty: bool = False) -> dict:
    """A model weight, one Gefen parameter's v3 state with its records, a counter
    (``empty``: and a zero-byte raw entry, as an empty shard writes, of a parameter without records)."""
    g = torch.Generator().manual_seed(0)
    mag, vmean = torch.rand(8, 4, generator=g), torch.rand(8, 4, generator=g)
    record = gefen_records.OptimizerRecord(False, 3,
                                            [gefen_records.ParamRecord("layers.0.w", (8, 16), 4, 3, 3, GROUP)])
    sd = {"model.w": torch.randn(8, 16, generator=g),
          CODES: torch.randint(0, 256, (8, 16), dtype=torch.uint8, generator=g),
          GRID: gefen_keys.pack_blocks(mag, vmean),
          "optimizer." + schema.header_key(): schema_records.Header.for_blocking("agreed").to_json(),
          "optimizer." + gefen_keys.optimizer_key("layers.0.w"): record.to_json(),
          "optimizer." + gefen_keys.codebook_key("layers.0.w"): torch.linspace(-1, 1, schema.K),
          "step": torch.tensor(7)}
    if empty:
        sd[EMPTY] = torch.empty(0, 4, 2)
    return sd


def blank(empty: bool = False) -> dict:
    return {key: "" if isinstance(value, str) else torch.zeros_like(value) for key, value in state(empty).items()}


def test_which_entries_are_raw():
    """v3's own keys, and no key an earlier format wrote (their items are framed)."""
    assert schema.is_raw_entry(CODES) and schema.is_raw_entry(GRID)
    assert set(gefen_keys.param_tensor_keys("x").values()) == {gefen_keys.qcodes_key("x"), gefen_keys.grid_key("x")}
    earlier = [*gefen_keys.param_tensor_keys("x", schema.V2).values(), *muon_keys.muon_tensor_keys("x").values(),
               gefen_keys.records_key("x", 0), gefen_keys.blocks_key("x", 0), gefen_keys.rank_codebook_key("x", 0)]
    for name in earlier:
        assert not schema.is_raw_entry("optimizer." + name), name
    grid_bytes = 8 * 4 * 2 * 4
    assert schema.is_raw_item(GRID, grid_bytes, torch.float32, (8, 4, 2))
    assert not schema.is_raw_item(GRID, grid_bytes + 1500, torch.float32, (8, 4, 2))  # framed: longer
    assert not schema.is_raw_item("model.w", grid_bytes, torch.float32, (8, 4, 2))
    for flat in ("model.w", "optimizer." + schema.header_key(), "optimizer." + gefen_keys.optimizer_key("x"),
                 "optimizer." + gefen_keys.codebook_key("x"), "optimizer.state.w.exp_avg", "step"):
        assert not schema.is_raw_entry(flat), flat


def test_pack_unpack_and_specs():
    mag, vmean = torch.rand(3, 5), torch.rand(3, 5)
    grid = gefen_keys.pack_blocks(mag, vmean)
    assert grid.shape == (3, 5, 2)
    m, v = gefen_keys.unpack_blocks(schema.VERSION, {"grid": grid})
    assert torch.equal(m, mag) and torch.equal(v, vmean)
    m, v = gefen_keys.unpack_blocks(schema.V2, {"magnitude": mag, "vmean": vmean})
    assert m is mag and v is vmean
    with pytest.raises(schema.FormatError):
        gefen_keys.unpack_blocks(schema.VERSION, {"grid": torch.zeros(3, 5)})
    v3 = gefen_keys.param_tensor_specs("w", (6, 12), 4)
    assert v3 == {"gefen/qcodes/w": (torch.uint8, (6, 12)), "gefen/grid/w": (torch.float32, (6, 3, 2))}
    v2 = gefen_keys.param_tensor_specs("w", (6, 12), 4, schema.V2)
    assert sorted(v2) == ["gefen/codes/w", "gefen/magnitude/w", "gefen/vmean/w"]


@pytest.mark.parametrize("empty", [False, True])
def test_raw_round_trip_has_no_framing(tmp_path, empty):
    path = tmp_path / "step-1"
    want = state(empty)
    dcp.save(want, storage_writer=storage.storage_writer(path), no_dist=True)
    md = storage.read_metadata(path)
    infos = {index.fqn: info for index, info in md.storage_data.items()}
    for key in (CODES, GRID, EMPTY) if empty else (CODES, GRID):
        t = want[key]
        assert not infos[key].transform_descriptors, key
        assert infos[key].length == t.numel() * t.element_size(), key  # the bytes alone
        stored = (path / infos[key].relative_path).read_bytes()
        assert stored[infos[key].offset:infos[key].offset + infos[key].length] == t.numpy().tobytes()
    framed = infos["model.w"]
    assert not framed.transform_descriptors and framed.length > want["model.w"].numel() * 4 + 500
    got = blank(empty)
    dcp.load(got, storage_reader=storage.storage_reader(path), no_dist=True)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value
    if not empty:  # (an entry without its records is, rightly, a problem for verify)
        report = verify_checkpoint(str(path))
        assert report["ok"], report["problems"]


def test_dcp_own_reader_fails_on_raw_entries_but_reads_the_rest(tmp_path):
    path = tmp_path / "step-1"
    dcp.save(state(), storage_writer=storage.storage_writer(path), no_dist=True)
    model = {"model.w": torch.zeros(8, 16)}
    dcp.load(model, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert torch.equal(model["model.w"], state()["model.w"])
    with pytest.raises(BaseException, match="torch.load"):  # of raw bytes (DCP wraps it in a CheckpointException)
        dcp.load({CODES: torch.zeros(8, 16, dtype=torch.uint8)}, storage_reader=dcp.FileSystemReader(str(path)),
                 no_dist=True)


def test_raw_entries_load_without_digests(tmp_path):
    """A checkpoint whose .digests was removed still reads its raw entries (unchecked)."""
    path = tmp_path / "step-1"
    dcp.save(state(), storage_writer=storage.storage_writer(path), no_dist=True)
    os.remove(path / ".digests")
    got = blank()
    dcp.load(got, storage_reader=storage.storage_reader(path), no_dist=True)
    assert torch.equal(got[GRID], state()[GRID]) and torch.equal(got[CODES], state()[CODES])


def test_flipped_raw_byte_is_refused(tmp_path):
    path = tmp_path / "step-1"
    dcp.save(state(), storage_writer=storage.storage_writer(path), no_dist=True)
    info = next(i for idx, i in storage.read_metadata(path).storage_data.items() if idx.fqn == GRID)
    file = path / info.relative_path
    data = bytearray(file.read_bytes())
    data[info.offset + random.Random(1).randrange(info.length)] ^= 0x10
    file.write_bytes(bytes(data))
    got = blank()
    with pytest.raises(BaseException, match="digest mismatch"):
        dcp.load(got, storage_reader=storage.storage_reader(path), no_dist=True)
    # Nothing reached a target that may be live (the model's); a raw entry's
    # target is an adapter's staging tensor, dropped with the failed load.
    assert torch.equal(got["model.w"], torch.zeros(8, 16))
    report = verify_checkpoint(str(path))
    assert not report["ok"]


def test_v3_keys_saved_framed_by_dcp_own_writer_still_read(tmp_path):
    """A v3 state dict saved again by DCP's own writer (as ``torch_save_to_dcp`` does) has framed
    items under raw keys: the length tells them apart, so gefen-titan's reader and verify read them."""
    path = tmp_path / "step-1"
    want = state()
    dcp.save(want, checkpoint_id=str(path), no_dist=True)
    md = storage.read_metadata(path)
    info = next(i for idx, i in md.storage_data.items() if idx.fqn == GRID)
    assert info.length > want[GRID].nbytes  # framed
    got = blank()
    dcp.load(got, storage_reader=storage.storage_reader(path), no_dist=True)
    assert torch.equal(got[GRID], want[GRID]) and torch.equal(got[CODES], want[CODES])
    report = verify_checkpoint(str(path))
    assert report["ok"], report["problems"]


def test_a_raw_entry_larger_than_a_write_piece_is_digested_whole(tmp_path):
    """The writer writes and hashes a large raw entry piece by piece (``digests.PIECE``, 1 MiB):
    its recorded digest is still that of all its stored bytes, and it reads back bit for bit."""
    g = torch.Generator().manual_seed(1)
    rows = 3 * digests.PIECE // 16 + 5  # three pieces and a ragged tail
    sd = {CODES: torch.randint(0, 256, (rows, 16), dtype=torch.uint8, generator=g), "step": torch.tensor(2)}
    path = tmp_path / "big"
    dcp.save(sd, storage_writer=storage.storage_writer(path), no_dist=True)
    md, record = storage.read_checked_metadata(path)
    info = next(v for k, v in md.storage_data.items() if k.fqn == CODES)
    assert info.length == rows * 16  # raw: no framing
    raw = (path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    assert record.item(info.relative_path, info.offset, info.length) == digests.hexdigest(raw)
    got = {CODES: torch.zeros_like(sd[CODES]), "step": torch.tensor(0)}
    dcp.load(got, storage_reader=storage.storage_reader(path), no_dist=True)
    assert torch.equal(got[CODES], sd[CODES]) and int(got["step"]) == 2
