"""``.digests``: written by every save through ``storage.storage_writer``, checked by every load.

One process, DCP with ``no_dist=True``: the writer and reader pair of
``checkpoint.io.writing`` and ``checkpoint.io.reading`` on a small state dict of tensors and an object
entry. The multi-rank resume of a real recipe is
tests/integration/test_checkpoint_integrity.py.
"""

import io
import json
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import digests, schema_doc
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.verify import verify_checkpoint

DOC = (Path(__file__).resolve().parents[2] / "docs" / "checkpoint_format.md").read_text()
pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "codes": torch.randint(0, 255, (300,), dtype=torch.uint8,
                                                                          generator=g),
            "record": '{"format": "x", "values": [1, 2, 3]}', "step": torch.tensor(7)}


def blank() -> dict:
    return {"w": torch.full((64, 32), -1.0), "codes": torch.zeros(300, dtype=torch.uint8), "record": "",
            "step": torch.tensor(0)}


def save(path: Path) -> Path:
    dcp.save(state(), storage_writer=storage.storage_writer(path), no_dist=True)
    return path


def load(path: Path) -> dict:
    sd = blank()
    dcp.load(sd, storage_reader=storage.storage_reader(path), no_dist=True)
    return sd


def test_round_trip_writes_digests_of_every_item_and_metadata(tmp_path):
    path = save(tmp_path / "step-1")
    record = storage.read_digests(path)
    md = storage.read_metadata(path)
    assert record is not None and record.count() == len(md.storage_data)
    for info in md.storage_data.values():  # each recorded digest is that of the item's stored bytes
        raw = (path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        assert record.item(info.relative_path, info.offset, info.length) == digests.hexdigest(raw)
    assert record.metadata_digest == digests.hexdigest((path / ".metadata").read_bytes())
    sd, want = load(path), state()
    assert torch.equal(sd["w"], want["w"]) and torch.equal(sd["codes"], want["codes"])
    assert sd["record"] == want["record"] and int(sd["step"]) == 7
    assert verify_checkpoint(str(path))["ok"]


def test_every_random_flip_is_refused_before_any_target_changes(tmp_path):
    """40 seeded single-byte flips spread over every file; the load's targets keep their values."""
    src = save(tmp_path / "src" / "step-1")
    names = sorted(os.listdir(src))
    assert digests.FILE in names and ".metadata" in names
    rng = random.Random(0)
    refused = 0
    for i in range(40):
        name = names[i % len(names)]
        dst = tmp_path / f"c{i}" / "step-1"
        dst.mkdir(parents=True)
        for n in names:
            (dst / n).write_bytes((src / n).read_bytes())
        data = bytearray((dst / name).read_bytes())
        offset = rng.randrange(len(data))
        data[offset] ^= rng.randrange(1, 256)
        (dst / name).write_bytes(bytes(data))
        sd = blank()
        with pytest.raises(BaseException) as err:  # DCP's CheckpointException is a BaseException
            dcp.load(sd, storage_reader=storage.storage_reader(dst), no_dist=True)
        assert "is corrupt" in str(err.value) and name in str(err.value), (name, offset, str(err.value))
        assert bool((sd["w"] == -1).all()) and not sd["codes"].any(), f"{name}@{offset} reached a target"
        report = verify_checkpoint(str(dst))
        assert not report["ok"] and report["first_bad_file"] == name, (name, offset, report["problems"])
        refused += 1
    assert refused == 40


def from_bytes(raw: bytes) -> digests.Digests:
    return digests.read(lambda: io.BytesIO(raw), "x")


def test_every_byte_of_the_digest_file_counts(tmp_path):
    """A flip in the header or the index is refused on reading; one in a data file's section when that
    section is first needed (``Digests.check``: what an item's lookup does)."""
    raw = (save(tmp_path / "step-1") / digests.FILE).read_bytes()
    record = from_bytes(raw)
    assert record.count() > 0 and record.files()
    for i in range(len(raw)):
        for flip in (0x01, 0x20, 0x80):
            bad = bytearray(raw)
            bad[i] ^= flip
            with pytest.raises(digests.CorruptCheckpointError) as err:
                damaged = from_bytes(bytes(bad))
                for file in damaged.files():
                    damaged.check(file)
            assert err.value.file == digests.FILE


def test_a_load_decodes_the_digest_file_once_and_still_checks_every_read(tmp_path):
    """Within ``parsed_once`` (the manager's load) the same checked bytes give the same record; a
    flipped byte is refused as outside it; another checkpoint gets its own; nothing outlives the scope."""
    raw = (save(tmp_path / "step-1") / digests.FILE).read_bytes()
    other = (save_other(tmp_path / "step-2") / digests.FILE).read_bytes()
    bad = bytearray(raw)
    bad[raw.index(b"\n") + 5] ^= 0x01  # in the index, which the header's digest covers
    with digests.parsed_once():
        first = from_bytes(raw)
        with digests.parsed_once():  # nested: the outer scope's records
            assert from_bytes(raw) is first
        assert from_bytes(raw) is first
        with pytest.raises(digests.CorruptCheckpointError):
            from_bytes(bytes(bad))
        second = from_bytes(other)
        assert second is not first and second.metadata_digest != first.metadata_digest
    assert from_bytes(raw) is not first and from_bytes(raw).to_bytes() == first.to_bytes() == raw


def test_digest_file_version_1_is_still_read(tmp_path):
    """Version 1 (one JSON object, its digest on the header line), written before the per-file sections."""
    path = save(tmp_path / "step-1")
    now = storage.read_digests(path)
    items = {}
    for f in now.files():
        md = storage.read_metadata(path)
        items[f] = [[int(i.offset), int(i.length), now.item(f, i.offset, i.length)]
                    for i in md.storage_data.values() if i.relative_path == f and int(i.length)]
    body = json.dumps({"metadata": {"size": now.metadata_size, "digest": now.metadata_digest}, "items": items},
                      separators=(",", ":")).encode()
    (path / digests.FILE).write_bytes(f"gefen-digests 1 xxh3_64 {digests.hexdigest(body)}\n".encode() + body)
    old = storage.read_digests(path)
    assert old.count() == now.count() and old.to_bytes() == now.to_bytes()
    assert torch.equal(load(path)["w"], state()["w"]) and verify_checkpoint(str(path))["ok"]
    (path / digests.FILE).write_bytes(f"gefen-digests 1 xxh3_64 {digests.hexdigest(body)}\n".encode() + body[:-2])
    with pytest.raises(digests.CorruptCheckpointError, match="its own digest"):
        storage.read_digests(path)


def test_a_rank_reads_the_index_and_the_sections_it_needs(tmp_path):
    """At a thousand ranks ``.digests`` holds millions of rows; a reader reads the header, the index
    (here past the first read's 64 KiB) and the section of each file it asks about, each checked."""
    items = {f"__{r}_0.distcp": {o * 4096: (4096, f"{(r * 1000 + o):016x}") for o in range(50)} for r in range(2000)}
    raw = digests.Digests(123, "0123456789abcdef", items).to_bytes()
    (tmp_path / digests.FILE).write_bytes(raw)
    index_end = raw.index(b"\n", raw.index(b"\n") + 1) + 1
    assert index_end > 1 << 16 and len(raw) > 3 * index_end  # the index needs a second read

    read = []

    class Counting(io.FileIO):
        def read(self, n=-1):
            out = super().read(n)
            read.append(len(out))
            return out

    record = digests.read(lambda: Counting(tmp_path / digests.FILE), "x")
    assert record.count() == 2000 * 50 and record.metadata_size == 123
    assert record.item("__1234_0.distcp", 7 * 4096, 4096) == f"{1234007:016x}"
    assert record.item("__1234_0.distcp", 7 * 4096, 4095) is None and record.item("__9_0.distcp", 1, 4096) is None
    assert sum(read) < index_end + (1 << 16) + 50 * 40, (sum(read), index_end, len(raw))
    bad = bytearray(raw)
    bad[raw.index(b"4096 " + f"{5007:016x}".encode())] ^= 0x01  # a row of __5_0.distcp's section
    (tmp_path / digests.FILE).write_bytes(bytes(bad))
    record = digests.read(lambda: open(tmp_path / digests.FILE, "rb"), "x")
    assert record.item("__1234_0.distcp", 0, 4096) == f"{1234000:016x}"  # another file's section: intact
    with pytest.raises(digests.CorruptCheckpointError, match="section of __5_0.distcp does not match"):
        record.item("__5_0.distcp", 0, 4096)


def save_other(path: Path) -> Path:
    sd = state()
    sd["w"] = sd["w"] + 1
    dcp.save(sd, storage_writer=storage.storage_writer(path), no_dist=True)
    return path


def test_checkpoint_without_digests_loads_unchecked(tmp_path):
    path = tmp_path / "step-1"
    dcp.save(state(), checkpoint_id=str(path), no_dist=True)  # DCP's own writer, as torchtitan's
    assert storage.read_digests(path) is None
    sd = load(path)
    assert torch.equal(sd["w"], state()["w"])
    report = verify_checkpoint(str(path))
    assert report["ok"] and not report["digests"]


def test_corrupt_metadata_is_refused_before_unpickling(tmp_path):
    path = save(tmp_path / "step-1")
    raw = bytearray((path / ".metadata").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (path / ".metadata").write_bytes(bytes(raw))
    with pytest.raises(GefenCheckpointError, match=r"\.metadata: its xxh3_64 digest"):
        storage.read_metadata(path)


def test_error_names_the_older_step(tmp_path):
    save(tmp_path / "checkpoint" / "step-2")
    path = save(tmp_path / "checkpoint" / "step-5")
    msg = digests.corrupt_message(str(path), "__0_0.distcp", "optimizer.x", "bad")
    assert "__0_0.distcp, entry optimizer.x: bad" in msg and "--checkpoint.load_step 2" in msg


def test_writer_pickles_for_process_based_async_saves(tmp_path):
    writer = pickle.loads(pickle.dumps(storage.storage_writer(tmp_path / "step-1")))
    dcp.save(state(), storage_writer=writer, no_dist=True)
    assert storage.read_digests(tmp_path / "step-1") is not None
    assert torch.equal(load(tmp_path / "step-1")["w"], state()["w"])


def test_corrupt_error_pickles_across_ranks():
    e = pickle.loads(pickle.dumps(digests.CorruptCheckpointError("m", digests.FILE, what="w")))
    assert isinstance(e, GefenCheckpointError) and str(e) == "m"


def test_doc_shows_the_digest_file_table():
    assert schema_doc.file_table() in DOC, ("docs/checkpoint_format.md's .digests table differs from "
                                         "gefen_titan.checkpoint.format.schema_doc.file_table(); paste it into the doc")


def test_digests_handed_to_the_reader_are_kept(tmp_path):
    """A reader given ``digests`` (here None: load unchecked) but no metadata keeps them when it reads
    ``.metadata``; it does not take up the folder's ``.digests`` instead."""
    path = save(tmp_path / "step-1")
    reader = storage.storage_reader(path, digests=None)
    reader.read_metadata()
    assert reader.digests() is None
    assert storage.storage_reader(path).digests() is not None  # by default it reads them
