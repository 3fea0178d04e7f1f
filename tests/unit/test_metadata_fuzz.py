"""A seeded, bounded structured fuzzer over ``.metadata`` and ``.digests`` (issue 38, item 3).

The tiny checkpoint of ``tests.helpers.tiny_checkpoint`` (Gefen state with
raw entries, framed model tensors, byte entries) is saved once. Each case
makes one change, chosen by a seeded generator, and rewrites ``.digests`` to
match, as a writer without the key would:

* a field of ``.metadata``: a tensor's declared size, a chunk's offsets or
  sizes, a chunk added or dropped, a dtype, an item's offset, length or file;
* a value of another type in any field of DCP's metadata objects (every field
  is drawn, a key of ``storage_data`` too), and a chunk split into as many
  chunks as it has rows (chunk counts; issue 50);
* pickles of allowed types past the budgets: nesting (65-300 deep) and
  sharing (one 200-400 KB string referred to 1,000-3,000 times);
* ``.digests``' rows, or ``.metadata``'s recorded size;
* files of the folder: a FIFO, a link to ``/dev/zero`` or a directory in
  place of ``.metadata``, ``.digests`` or the data file; a sparse
  ``.metadata`` or ``.digests`` of 1-16 GiB; a byte entry whose archive
  members are deflated (up to ~1000:1).

Then, in one process:

* the resume either refuses, with a message naming the entry changed and a
  check of ``load_checks`` (or the file), and leaves the model untouched, or
  loads exactly the state the unchanged checkpoint loads;
* ``ckpt verify`` agrees with it (fails exactly when the resume refuses);
* nothing is allocated beyond the files' bytes: a case the metadata stage
  passes has ``metadata_checks.allocation`` within them, and a case it refuses
  was refused before any read (every read of a 2^40-element size or a
  2^50-byte length would fail to allocate with another message);
* each case takes under ``LIMIT_S``.

The case count and outcomes are printed (``-s``). Multi-rank agreement on a
refusal is the DCP gather's, pinned by
tests/integration/test_checkpoint_integrity.py.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import signal
import time
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from gefen_titan.checkpoint.checks import metadata_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import digests
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from gefen_titan.optim import gefenx as gx
from tests.helpers.tiny_checkpoint import STEP, build, edit_metadata, manager, save
from tests.helpers.untrusted import digest_rows, replace_item

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

SEED = 50
CASES = 160
LIMIT_S = 5.0  # per case; a case takes ~0.02-0.3 s here (measured 2026-12-06)
ALARM_S = 30
_HUGE = (1 << 40, 1 << 50)
_DTYPES = (torch.float32, torch.int32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8)


def _ints(rng: random.Random, v: int) -> int:
    return rng.choice([v + 1, v - 1, 2 * v, 0, -1, *_HUGE])


def _tensor(md, rng):
    key = rng.choice(sorted(k for k, e in md.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata)))
    return key, md.state_dict_metadata[key]


def _size(md, rng) -> str:
    key, e = _tensor(md, rng)
    size = list(e.size) or [1]
    d = rng.randrange(len(size))
    size[d] = _ints(rng, size[d])
    e.size = torch.Size(size) if min(size) >= 0 else tuple(size)
    return key


def _chunk_offsets(md, rng) -> str:
    key, e = _tensor(md, rng)
    c = e.chunks[0]
    if not len(c.offsets):
        return _size(md, rng)
    off = list(c.offsets)
    d = rng.randrange(len(off))
    off[d] = _ints(rng, off[d])
    e.chunks[0] = ChunkStorageMetadata(offsets=torch.Size(off) if min(off) >= 0 else tuple(off), sizes=c.sizes)
    return key


def _chunk_sizes(md, rng) -> str:
    key, e = _tensor(md, rng)
    c = e.chunks[0]
    if not len(c.sizes):
        return _size(md, rng)
    sizes = list(c.sizes)
    d = rng.randrange(len(sizes))
    sizes[d] = _ints(rng, sizes[d])
    e.chunks[0] = ChunkStorageMetadata(offsets=c.offsets, sizes=torch.Size(sizes) if min(sizes) >= 0 else tuple(sizes))
    return key


def _extra_chunk(md, rng) -> str:  # the first chunk again (an overlap), or a copy moved past the end
    key, e = _tensor(md, rng)
    c = e.chunks[0]
    if rng.random() < 0.5 or not len(c.offsets):
        e.chunks.append(c)
    else:
        e.chunks.append(ChunkStorageMetadata(offsets=torch.Size([c.offsets[0] + c.sizes[0], *c.offsets[1:]]),
                                             sizes=c.sizes))
    return key


def _missing_chunk(md, rng) -> str:
    key, e = _tensor(md, rng)
    e.chunks.pop(rng.randrange(len(e.chunks)))
    return key


def _dtype(md, rng) -> str:
    key, e = _tensor(md, rng)
    e.properties.dtype = rng.choice([d for d in _DTYPES if d != e.properties.dtype])
    return key


def _item(md, rng):
    index = rng.choice(sorted(md.storage_data, key=lambda i: (i.fqn, tuple(i.offset or ()))))
    return index.fqn, md.storage_data[index]


def _item_offset(md, rng) -> str:
    key, info = _item(md, rng)
    info.offset = _ints(rng, info.offset)
    return key


def _item_length(md, rng) -> str:
    key, info = _item(md, rng)
    info.length = _ints(rng, info.length)
    return key


def _item_type(md, rng) -> str:  # what a crafted pickle may hold where DCP writes an int
    key, info = _item(md, rng)
    setattr(info, rng.choice(["offset", "length"]), rng.choice([None, "0", 1.5, True, [0]]))
    return key


def _item_file(md, rng) -> str:
    key, info = _item(md, rng)
    info.relative_path = rng.choice(["__1_0.distcp", "../__0_0.distcp", ".digests", ".metadata", ""])
    return key


_WRONG = (None, 7, "x", 1.5, [0], {}, ("deep",))  # what a crafted pickle may hold where DCP writes another type


def _nested(depth: int) -> tuple:
    out: tuple = ("x",)
    for _ in range(depth):
        out = (out,)
    return out


def _field_type(md, rng) -> str:
    """One field of one of DCP's metadata objects set to a value of another type (every field is drawn):
    refused naming the field (the entry where the field is an entry's), or loaded the same."""
    key, e = _tensor(md, rng)
    index, info = rng.choice(sorted(md.storage_data.items(), key=lambda kv: (kv[0].fqn, tuple(kv[0].offset or ()))))
    fields = [(md, f, f) for f in ("state_dict_metadata", "storage_data", "planner_data", "storage_meta", "version")]
    fields += [(e, f, key) for f in ("properties", "size", "chunks")] + [(e.properties, "dtype", key)]
    fields += [(e.chunks[0], f, key) for f in ("offsets", "sizes")]
    fields += [(info, f, index.fqn) for f in ("relative_path", "offset", "length", "transform_descriptors")]
    fields += [(md.storage_meta, f, f"storage_meta.{f}") for f in ("checkpoint_id", "save_id", "load_id", "modules")]
    obj, field, named = rng.choice(fields)
    value = rng.choice(_WRONG)
    setattr(obj, field, _nested(rng.randrange(2, 40)) if value == ("deep",) else value)
    return named


def _index_type(md, rng) -> str:  # a key of storage_data (a MetadataIndex) of another type or with a bad field
    index = rng.choice(sorted(md.storage_data, key=lambda i: (i.fqn, tuple(i.offset or ()))))
    info = md.storage_data.pop(index)
    bad = rng.choice([index.fqn, (index.fqn,), MetadataIndex(index.fqn, index.offset, index.index)])
    named = "storage_data"
    if isinstance(bad, MetadataIndex):
        field = rng.choice(["fqn", "offset", "index"])
        object.__setattr__(bad, field, rng.choice([1.5, ("x",), "x"] if field != "fqn" else [1.5, 7, None]))
        named = "storage_data" if field == "fqn" else index.fqn
    md.storage_data[bad] = info
    return named


def _chunk_count(md, rng) -> str:  # one chunk split into many one-row chunks, all in the file of the first
    key, e = _tensor(md, rng)
    c = e.chunks[0]
    if not len(c.sizes) or c.sizes[0] < 2:
        return _size(md, rng)
    rows = [ChunkStorageMetadata(offsets=torch.Size([c.offsets[0] + i, *c.offsets[1:]]),
                                 sizes=torch.Size([1, *c.sizes[1:]])) for i in range(c.sizes[0])]
    e.chunks[0:1] = rows
    return key


def _depth(md, rng) -> str:  # allowed types only, nested past the budget (64)
    md.planner_data[next(iter(md.planner_data))] = _nested(rng.randrange(65, 300))
    return ".metadata"


def _sharing(md, rng) -> str:  # one string shared by hundreds of places: cheap to pickle, GBs to build per use
    big = "s" * rng.randrange(200_000, 400_000)
    md.storage_meta.modules = [big] * rng.randrange(1_000, 3_000)
    return ".metadata"


MUTATIONS = {f.__name__.strip("_"): f for f in (_size, _chunk_offsets, _chunk_sizes, _extra_chunk, _missing_chunk,
                                                _dtype, _item_offset, _item_length, _item_type, _item_file,
                                                _field_type, _index_type, _chunk_count, _depth, _sharing)}


# Files of the folder replaced as a writer of the folder can (no .digests rewrite needs the key): each
# returns the text the refusal names. A reader that opened a FIFO would block: SIGALRM (ALARM_S) ends
# the case with a failure instead of a hang.
def _special_file(step: Path, rng: random.Random) -> str:
    path = step / rng.choice([".metadata", digests.FILE, "__0_0.distcp"])
    path.unlink()
    kind = rng.choice(["fifo", "zero", "dir"])
    if kind == "fifo":
        os.mkfifo(path)
        return f"{path} is a FIFO"
    if kind == "zero":
        path.symlink_to("/dev/zero")
        return f"{path} is a character device"
    path.mkdir()
    return f"{path} is a directory"


def _sparse_file(step: Path, rng: random.Random) -> str:
    name = rng.choice([".metadata", digests.FILE])
    os.truncate(step / name, rng.choice([1 << 30, 3 << 30, (1 << 34) + rng.randrange(1 << 20)]))
    return name


def _deflated_entry(step: Path, rng: random.Random) -> str:
    """A byte entry whose archive members are compressed: ratio up to 1000:1, refused before inflating."""
    buf = io.BytesIO()
    torch.save(torch.zeros(rng.randrange(1 << 16, 1 << 22), dtype=torch.uint8), buf)
    bomb = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as dst:
        for member in src.infolist():
            dst.writestr(member.filename, src.read(member))
    key = rng.choice(["train_state.step", "extra.note.seen"])
    replace_item(step, key, bomb.getvalue())
    return key


FILE_MUTATIONS = {f.__name__.strip("_"): f for f in (_special_file, _sparse_file, _deflated_entry)}


# .digests, rewritten whole after the change, consistent with itself (its index and sections are the
# writer's): one row moved, cut, dropped, or added for a file the folder does not hold, or .metadata's
# recorded size changed. Each returns the data file (or ".metadata") the change is about.
def _row(rows, rng):
    file = rng.choice(sorted(rows))
    return file, rng.choice(sorted(rows[file]))


def _row_offset(rows, meta, rng):
    file, off = _row(rows, rng)
    rows[file][_ints(rng, off)] = rows[file].pop(off)
    return file, meta


def _row_length(rows, meta, rng):
    file, off = _row(rows, rng)
    length, digest = rows[file][off]
    rows[file][off] = (max(_ints(rng, length), 0), digest)
    return file, meta


def _row_dropped(rows, meta, rng):
    file, off = _row(rows, rng)
    del rows[file][off]
    return file, meta


def _row_of_another_file(rows, meta, rng):
    rows["__7_0.distcp"] = {0: (16, "0" * 16)}
    return "__7_0.distcp", meta


def _metadata_size(rows, meta, rng):
    return ".metadata", (max(_ints(rng, meta[0]), 0), meta[1])


DIGEST_MUTATIONS = {f.__name__.strip("_"): f for f in (_row_offset, _row_length, _row_dropped, _row_of_another_file,
                                                       _metadata_size)}


def _edit_digests(step: Path, name: str, rng: random.Random) -> str:
    size, digest, rows = digest_rows(step, storage.read_metadata(step))
    file, (size, digest) = DIGEST_MUTATIONS[name](rows, (size, digest), rng)
    (step / digests.FILE).write_bytes(digests.Digests(size, digest, rows).to_bytes())
    return file


def _state(net, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in net.parameters()]
    for o in opt.optimizers:
        out += [v.clone() for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        cb = gx.codebook(o)
        out.append(torch.empty(0) if cb is None else cb.clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b))


def _timed_out(signum, frame):
    raise TimeoutError(f"a case ran past {ALARM_S} s (a blocked read?)")


def test_fuzzed_metadata_is_refused_naming_the_field_or_loads_the_same_state(tmp_path):
    previous = signal.signal(signal.SIGALRM, _timed_out)
    try:
        _fuzz(tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _fuzz(tmp_path):
    clean = save(tmp_path / "saved")
    net, opt = build(5)
    assert manager(clean.parents[1], net, opt).load(step=STEP)
    expected = _state(net, opt)
    files = sum(f.stat().st_size for f in clean.glob("*.distcp"))
    rng = random.Random(SEED)
    outcomes: Counter = Counter()
    for case in range(CASES):
        name = rng.choice(sorted(MUTATIONS) + sorted(DIGEST_MUTATIONS) + sorted(FILE_MUTATIONS))
        root = tmp_path / f"case{case}"
        step = root / "ckpt" / f"step-{STEP}"
        shutil.copytree(clean, step)
        changed: list[str] = []
        if name in MUTATIONS:
            edit_metadata(step, lambda md: changed.append(MUTATIONS[name](md, rng)))
        elif name in FILE_MUTATIONS:
            changed.append(FILE_MUTATIONS[name](step, rng))
        else:
            changed.append(_edit_digests(step, name, rng))
        what = f"case {case} ({name} of {changed[0]})"
        start = time.perf_counter()
        signal.alarm(ALARM_S)  # a blocked open of a FIFO fails the case instead of hanging the suite
        try:
            md = storage.read_metadata(step)  # the .digests cases may be refused here already
            problems = storage.metadata_problems(step, md)
        except GefenCheckpointError:
            md, problems = None, []
        net, opt = build(5)
        before = _state(net, opt)
        try:
            manager(root, net, opt).load(step=STEP)
            refused = None
        except GefenCheckpointError as e:
            refused = str(e)
        report = verify_checkpoint(str(step))
        signal.alarm(0)
        took = time.perf_counter() - start
        assert took < LIMIT_S, f"{what}: {took:.1f} s"
        assert report["ok"] == (refused is None), (what, refused, report["problems"])
        if refused is None:
            assert md is not None and not problems and metadata_checks.allocation(md) <= files, what
            assert _same(_state(net, opt), expected), f"{what}: loaded, and not the saved state"
            outcomes[f"{name}: loaded the same state"] += 1
            continue
        # The entry (the records stage names an optimizer tensor by its name inside the component), or
        # for .digests the file whose row changed.
        assert changed[0].removeprefix("optimizer.") in refused, f"{what}: {refused}"
        assert _same(_state(net, opt), before), f"{what}: the refused load changed the model or optimizer"
        if problems:
            assert "before any buffer was allocated" in refused, (what, refused)
        outcomes[f"{name}: refused ({'metadata stage' if problems else 'on read'})"] += 1
    print(f"\n{CASES} fuzzed checkpoint cases (seed {SEED}):")
    for k, n in sorted(outcomes.items()):
        print(f"  {n:3d}  {k}")
    assert sum(outcomes.values()) == CASES
