"""DCP storage writers that record ``.digests`` and readers that check it before anything is used.

**Save.** The writers are DCP's own (``FileSystemWriter``, ``FsspecWriter``)
with their file system wrapped: each data file's stream digests what DCP
writes into it, one digest per stored item (DCP's ``_write_item`` asks the
stream's ``tell()`` before and after each item, and only there: the bytes
between two ``tell()`` calls are one item; an item that does not line up,
as a future DCP might write, is read back and digested instead, slower and
as exact). The digests travel to the coordinator inside the write results
and ``finish`` takes them out again, so ``.metadata`` is byte for byte what
DCP alone writes (torchtitan's and torch's readers read it as before).
``.digests`` is written, then ``.metadata`` renamed into place: a step folder
with a ``.metadata`` has its ``.digests``. The digest rides on bytes already
in memory, so synchronous and asynchronous saves (threads or a process: the
writer pickles) cost one pass of xxh3 over the bytes written.

**Load.** ``read_metadata`` checks ``.metadata``'s bytes before unpickling
them (a flipped byte never reaches ``pickle``). ``read_data`` reads every
item this rank's plan needs, checks each digest, and only when every rank's
items are intact (when ``agree``: one all-gather of whether each rank
could read ``.digests``, one all-reduce of the verdicts) deserializes them into the
planner's targets, which for the model are the live parameters: a damaged
byte anywhere stops the load on every rank before the first in-place copy.
With ``check_unread`` the coordinator also hands every stored item that no
rank's plan reads (another rank's data-loader entries, an excluded
component) to the rank with the fewest such bytes, so each load checks
every item of the checkpoint once. Cost: one xxh3 pass over the bytes read,
and the rank's items held in memory between the read and the commit (DCP
holds one at a time). A checkpoint without ``.digests`` is read by DCP's own
``read_data``, unchecked.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import posixpath
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from gefen_titan.checkpoint import digests as dg
from gefen_titan.checkpoint.errors import root_cause
from gefen_titan.distributed import all_gather_objects, is_distributed, raise_on_any_rank

__all__ = ["CheckedFileSystemReader", "CheckedFsspecReader", "DigestingFileSystemWriter", "DigestingFsspecWriter",
           "load_metadata"]

_CHUNK = 1 << 24  # bytes per read when an item is read back or read in pieces
_UNSET: Any = object()


# ------------------------------------------------------------------ save
class _HashingStream:
    """A write stream that digests the bytes between consecutive ``tell()`` calls (DCP's items)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._pos = 0  # a new file ("wb"): the count of bytes written is the position
        self._start = 0
        self._hasher = dg.new_hasher()
        self.segments: dict[tuple[int, int], str] = {}
        self._done = False

    def write(self, b: Any) -> int:
        # torch.save writes each record in many small pieces: this is the
        # save's hot path, kept to one call each. DCP's streams are buffered
        # (a write takes all its bytes or raises), so ``b`` is what was written.
        n = self._raw.write(b)
        self._hasher.update(b)
        self._pos += n
        return n

    def tell(self) -> int:
        self._cut()
        return self._pos

    def _cut(self) -> None:
        self.segments[(self._start, self._pos)] = self._hasher.hexdigest()
        self._start, self._hasher = self._pos, dg.new_hasher()

    def close(self) -> None:
        if not self._done:
            self._cut()
            self._done = True
        self._raw.close()

    def __getattr__(self, name: str) -> Any:  # flush, fileno, writable, closed, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._raw, name)


@dataclass
class _Ledger:
    """What one save's streams digested: ``files[path][(start, end)] = hex``; ``items`` for ``finish``."""

    files: dict[str, dict[tuple[int, int], str]] = dataclasses.field(default_factory=dict)
    items: dict[str, dict[int, tuple[int, str]]] | None = None
    sync: bool = False


class _DigestingFS:
    """DCP's file system object, its write streams digesting and its rename
    of ``.metadata`` into place writing ``.digests`` first."""

    def __init__(self, inner: Any, ledger: _Ledger) -> None:
        self._inner = inner
        self._ledger = ledger

    def __getattr__(self, name: str) -> Any:  # concat_path, init_path, mkdir, exists, rm_file, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str):
        with self._inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
            stream.close()
            self._ledger.files[str(path)] = stream.segments

    def rename(self, path: Any, new_path: Any) -> None:
        name = posixpath.basename(str(new_path).replace(os.sep, "/"))
        if name == dg.METADATA_FILE and self._ledger.items is not None:
            self._write_digests(path, new_path)
        self._inner.rename(path, new_path)

    def _write_digests(self, metadata_tmp: Any, metadata_path: Any) -> None:
        segments = self._ledger.files.get(str(metadata_tmp), {})
        whole = [(end, d) for (start, end), d in segments.items() if start == 0 and end > 0]
        if len(segments) - (1 if (0, 0) in segments else 0) == 1 and whole:
            size, digest = whole[0]
        else:  # written in several pieces: read it back
            size, digest = _digest_range(self._inner, metadata_tmp, 0, None)
        record = dg.Digests(size, digest, self._ledger.items or {})
        folder = os.path.dirname(os.fspath(metadata_path))
        final = self._inner.concat_path(folder, dg.FILE)
        tmp = self._inner.concat_path(folder, dg.FILE + ".tmp")
        with self._inner.create_stream(tmp, "wb") as f:
            f.write(record.to_bytes())
            if self._ledger.sync:
                try:
                    os.fsync(f.fileno())
                except (AttributeError, OSError, io.UnsupportedOperation):
                    pass
        if self._inner.exists(final):
            self._inner.rm_file(final)
        self._inner.rename(tmp, final)


def _digest_range(fs: Any, path: Any, offset: int, length: int | None) -> tuple[int, str]:
    """Size and digest of ``length`` bytes (None: to the end) of a file, read back."""
    hasher, n = dg.new_hasher(), 0
    with fs.create_stream(path, "rb") as f:
        f.seek(offset)
        while length is None or n < length:
            part = f.read(_CHUNK if length is None else min(_CHUNK, length - n))
            if not part:
                break
            hasher.update(part)
            n += len(part)
    return n, hasher.hexdigest()


@dataclass(frozen=True)
class _Digested:
    """A write result's storage info with the item's digest, on its way to ``finish``."""

    info: Any
    digest: str


class _DigestWriting:
    """Mixin over DCP's file system writers: digests every item and writes ``.digests`` (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ledger = _Ledger(sync=bool(getattr(self, "sync_files", False)))
        self.fs = _DigestingFS(self.fs, self._ledger)

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self._ledger.files.clear()
        self._ledger.items = None

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner).wait()
        out = [WriteResult(r.index, r.size_in_bytes, _Digested(r.storage_data, self._digest_of(r.storage_data)))
               for r in results]
        fut: Future = Future()
        fut.set_result(out)
        return fut

    def _digest_of(self, info: Any) -> str:
        path = self.fs.concat_path(self.path, info.relative_path)
        start, end = int(info.offset), int(info.offset) + int(info.length)
        found = self._ledger.files.get(str(path), {}).get((start, end))
        return found if found is not None else _digest_range(self.fs, path, start, end - start)[1]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        items: dict[str, dict[int, tuple[int, str]]] = {}
        plain = []
        for rank_results in results:
            kept = []
            for r in rank_results:
                if isinstance(r.storage_data, _Digested):
                    info = r.storage_data.info
                    items.setdefault(info.relative_path, {})[int(info.offset)] = (int(info.length),
                                                                                  r.storage_data.digest)
                    r = WriteResult(r.index, r.size_in_bytes, info)
                kept.append(r)
            plain.append(kept)
        self._ledger.items = items  # the rename of .metadata writes them (_DigestingFS.rename)
        try:
            super().finish(metadata, plain)
        finally:
            self._ledger.items = None


class DigestingFileSystemWriter(_DigestWriting, FileSystemWriter):
    """DCP's ``FileSystemWriter`` that also writes ``.digests``."""


class DigestingFsspecWriter(_DigestWriting, FsspecWriter):
    """DCP's ``FsspecWriter`` (checkpoints at URLs) that also writes ``.digests``."""


# ------------------------------------------------------------------ load
def load_metadata(fs: Any, path: Any, checkpoint_id: str) -> tuple[Metadata, dg.Digests | None]:
    """``.metadata`` checked against ``.digests`` (when there is one), then unpickled.

    Raises ``digests.CorruptCheckpointError`` for damaged bytes, OSError
    when a file cannot be read.
    """
    digest_path = fs.concat_path(path, dg.FILE)
    record = None
    if fs.exists(digest_path):
        with fs.create_stream(digest_path, "rb") as f:
            record = dg.parse(f.read(), checkpoint_id)
    with fs.create_stream(fs.concat_path(path, dg.METADATA_FILE), "rb") as f:
        raw = f.read()
    if record is not None:
        record.check_metadata(raw, checkpoint_id)
    try:
        metadata = pickle.loads(raw)
        if not isinstance(metadata, Metadata):
            raise TypeError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    except Exception as e:  # any unpickling failure of damaged bytes
        raise dg.CorruptCheckpointError(dg.corrupt_message(
            checkpoint_id, dg.METADATA_FILE, None, f"does not unpickle ({root_cause(e)})"), dg.METADATA_FILE) from e
    return metadata, record


class _CheckedReading:
    """Mixin over DCP's file system readers: checks ``.digests`` before anything is used (module docstring).

    ``metadata``/``digests``: already read (and checked) by the caller;
    ``agree``: the load is collective, so every rank's verdict is agreed
    before the first commit (an all-gather and an all-reduce); ``check_unread``: also check
    the items no rank reads.
    """

    def __init__(self, path: Any, *args: Any, metadata: Metadata | None = None, digests: Any = _UNSET,
                 agree: bool = False, check_unread: bool = False, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._metadata = metadata
        self._digests = digests
        self._agree = agree
        self._check_unread = check_unread

    def _id(self) -> str:
        return str(self.path)

    def digests(self) -> dg.Digests | None:
        """The checkpoint's ``.digests`` (None: it has none), read once."""
        if self._digests is _UNSET:
            if self._metadata is None:
                self._metadata, self._digests = load_metadata(self.fs, self.path, self._id())
            else:
                p = self.fs.concat_path(self.path, dg.FILE)
                self._digests = None
                if self.fs.exists(p):
                    with self.fs.create_stream(p, "rb") as f:
                        self._digests = dg.parse(f.read(), self._id())
        return self._digests

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank metadata fallback: not ours
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata, self._digests = load_metadata(self.fs, self.path, self._id())
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        if not (self._check_unread and self.digests() is not None and plans):
            return plans
        read = {item.storage_index for p in plans for item in p.items}
        extra: list[list[Any]] = [[] for _ in plans]
        load = [0] * len(plans)
        unread = sorted((i for i in self.storage_data if i not in read),
                        key=lambda i: -int(self.storage_data[i].length))
        for index in unread:  # largest first, each to the least loaded rank
            r = load.index(min(load))
            extra[r].append(index)
            load[r] += int(self.storage_data[index].length)
        return [dataclasses.replace(p, storage_data=x) if x else p for p, x in zip(plans, extra)]

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        # Every rank must take the same path through the collectives below,
        # so whether the checkpoint has digests (and whether they could be
        # read) is agreed first, in one all-gather, when the load is collective.
        try:
            record, error = self.digests(), None
        except Exception as e:  # a damaged .digests, an unreadable file
            record, error = None, str(e) if isinstance(e, dg.CorruptCheckpointError) else dg.corrupt_message(
                self._id(), dg.FILE, None, f"cannot read it ({root_cause(e)})")
        if self._agree and is_distributed():
            verdicts = all_gather_objects((error, record is not None))
            errors = sorted({e for e, _ in verdicts if e})
            if not errors and len({has for _, has in verdicts}) > 1:
                errors = [f"ranks disagree whether {self._id()} has {dg.FILE} (does every rank see the same files?)"]
            if errors:
                raise dg.CorruptCheckpointError("the checkpoint cannot be loaded: " + "; ".join(errors))
        elif error:
            raise dg.CorruptCheckpointError(error)
        if record is None:
            return super().read_data(plan, planner)
        staged, error = self._read_and_check(plan, record)
        if self._agree:
            raise_on_any_rank(error, "the checkpoint cannot be loaded", dg.CorruptCheckpointError)
        elif error:
            raise dg.CorruptCheckpointError(error)
        # Every rank's bytes are intact: only now does anything reach the planner's targets.
        uses: dict[Any, int] = {}
        for req in plan.items:
            uses[req.storage_index] = uses.get(req.storage_index, 0) + 1
        for req in plan.items:
            data = staged[req.storage_index]
            uses[req.storage_index] -= 1
            if not uses[req.storage_index]:
                del staged[req.storage_index]  # hold each item only until its last use
            info = self.storage_data[req.storage_index]
            stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(data))
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(stream.read(-1)))
                continue
            if not stream.seekable():
                stream = io.BytesIO(stream.read(-1))
            tensor = torch.load(stream, map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_and_check(self, plan: LoadPlan, record: dg.Digests) -> tuple[dict[Any, bytes], str | None]:
        """This rank's items (those of its plan, and the unread ones it was handed), each checked.

        Never raises: a failure is the returned message, so every rank
        reaches the agreement.
        """
        needed = {req.storage_index for req in plan.items}
        wanted = list(needed) + [i for i in (plan.storage_data or []) if i not in needed]
        per_file: dict[str, list[Any]] = {}
        for index in wanted:
            per_file.setdefault(self.storage_data[index].relative_path, []).append(index)
        staged: dict[Any, bytes] = {}
        file, entry = dg.METADATA_FILE, None
        try:
            for file in sorted(per_file):
                with self.fs.create_stream(self.fs.concat_path(self.path, file), "rb") as f:
                    for index in sorted(per_file[file], key=lambda i: int(self.storage_data[i].offset)):
                        entry = index.fqn
                        info = self.storage_data[index]
                        f.seek(int(info.offset))
                        data = _read_exact(f, int(info.length))
                        expected = record.item(file, info.offset, info.length)
                        if len(data) != int(info.length):
                            what = f"cannot read it: truncated, {len(data):,} of the item's {int(info.length):,} bytes"
                        elif expected is None:
                            what = "no digest was recorded for this item (.digests is from another save?)"
                        elif dg.hexdigest(data) != expected:
                            what = f"{dg.ALGORITHM} digest mismatch: its bytes differ from what the save wrote"
                        else:
                            if index in needed:
                                staged[index] = data
                            continue
                        return {}, dg.corrupt_message(self._id(), file, entry, what)
        except Exception as e:  # OSError, a missing file: the same agreement, the same message shape
            return {}, dg.corrupt_message(self._id(), file, entry, f"cannot read it ({root_cause(e)})")
        return staged, None


def _read_exact(f: Any, length: int) -> bytes:
    data = f.read(length)
    if len(data) == length or not data:
        return data
    parts = [data]
    left = length - len(data)
    while left > 0:
        part = f.read(min(left, _CHUNK))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class CheckedFileSystemReader(_CheckedReading, FileSystemReader):
    """DCP's ``FileSystemReader`` that checks ``.digests`` (module docstring)."""


class CheckedFsspecReader(_CheckedReading, FsspecReader):
    """DCP's ``FsspecReader`` (checkpoints at URLs) that checks ``.digests``."""
