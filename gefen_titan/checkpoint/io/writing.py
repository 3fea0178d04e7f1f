"""DCP storage writers that write format v3's raw entries and record ``.digests``.

**Items.** ``write_data`` lays out each rank's data files as DCP's own
``FileSystemWriter`` does (same names, same split by ``thread_count``, bytes
items first), written in one thread: a tensor whose key
``schema.is_raw_entry`` names (Gefen's v3 ``qcodes`` and ``grid``) as its
bytes alone; every other tensor (model, AdamW, GefenMuon, ...) as DCP writes it, one ``torch.save`` each, so
that DCP's own reader still reads them. torch.save frames each item with
about 1.5 KB (a zip archive: headers, 64-byte alignment, a directory); a
parameter's raw entries carry none, which is what keeps a small model's
optimizer state on disk within 1% of its size in memory.

**Digests.** The file system's write streams digest what is written
between two ``tell()`` calls, which ``_write_file`` makes around each item;
the digests travel to the coordinator inside the write results and
``finish`` takes them out again, so ``.metadata`` is what DCP would write
for these items. ``.digests`` is written, then ``.metadata`` renamed into
place: a step folder with a ``.metadata`` has its ``.digests``. The digest
rides on bytes already in memory, so synchronous and asynchronous saves
(threads or a process: the writer pickles) cost one pass of xxh3 over the
bytes written. The readers are ``checkpoint.io.reading``'s.
"""

from __future__ import annotations

import dataclasses
import io
import os
import posixpath
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from gefen_titan.checkpoint.format import digest_format, schema
from gefen_titan.checkpoint.format import digests as dg

__all__ = ["DigestingFileSystemWriter", "DigestingFsspecWriter"]

_CHUNK = 1 << 24  # bytes per read when an item is read back


# ------------------------------------------------------------------ save
class _HashingStream:
    """A write stream that digests the bytes between consecutive ``tell()`` calls (one item each)."""

    def __init__(self, raw: Any, hashing: bool = True, key: bytes | None = None) -> None:
        self._raw = raw
        self._hashing = hashing
        self._key = key
        self._pos = 0  # a new file ("wb"): the count of bytes written is the position
        self._start = 0
        self._hasher = dg.new_hasher(key)
        self.segments: dict[tuple[int, int], str] = {}
        self._done = False

    def write(self, b: Any) -> int:
        # torch.save writes each record in many small pieces: this is the
        # save's hot path, kept to one call each. The streams are buffered
        # (a write takes all its bytes or raises), so ``b`` is what was written.
        if self._hashing and len(b) > dg.PIECE:
            return self._write_pieces(memoryview(b).cast("B"))
        n = self._raw.write(b)
        if self._hashing:
            self._hasher.update(b)
        self._pos += n
        return n

    def _write_pieces(self, view: memoryview) -> int:
        # A raw entry arrives whole (tens of MB): each piece is hashed right
        # after the write has read it, while it is still in cache (one pass
        # over memory, not two).
        for i in range(0, len(view), dg.PIECE):
            piece = view[i:i + dg.PIECE]
            self._pos += self._raw.write(piece)
            self._hasher.update(piece)
        return len(view)

    def tell(self) -> int:
        self._cut()
        return self._pos

    def _cut(self) -> None:
        if self._hashing:
            self.segments[(self._start, self._pos)] = self._hasher.hexdigest()
            self._start, self._hasher = self._pos, dg.new_hasher(self._key)
        else:
            self.segments[(self._start, self._pos)] = ""
            self._start = self._pos

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
    hashing: bool = True  # False: no digests, no .digests (benchmarks measure the digests' own cost so)
    key: bytes | None = None  # keyed digests (a MAC; digests module docstring); held in memory only


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
            stream = _HashingStream(raw, self._ledger.hashing, self._ledger.key)
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
            size, digest = _digest_range(self._inner, metadata_tmp, 0, None, self._ledger.key)
        record = dg.Digests(size, digest, self._ledger.items or {}, key=self._ledger.key)
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


def _digest_range(fs: Any, path: Any, offset: int, length: int | None,
                  key: bytes | None = None) -> tuple[int, str]:
    """Size and digest of ``length`` bytes (None: to the end) of a file, read back."""
    hasher, n = dg.new_hasher(key), 0
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

    def __init__(self, *args: Any, digests: bool = True, key: bytes | None = None, **kwargs: Any) -> None:
        if kwargs.get("_extensions"):
            raise ValueError("gefen-titan's checkpoint writers take no DCP stream extensions (compression)")
        super().__init__(*args, **kwargs)
        self._ledger = _Ledger(sync=bool(getattr(self, "sync_files", False)), hashing=digests, key=key)
        self.fs = _DigestingFS(self.fs, self._ledger)

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self._ledger.files.clear()
        self._ledger.items = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        # DCP's own write_data, in one thread, with the item writing of
        # ``_write_file``: files named and split as DCP names and splits them.
        prefix = plan.storage_data.prefix
        buckets = (_split_by_size_and_type(self.thread_count, plan.items) if self.single_file_per_rank
                   else [[item] for item in plan.items])
        results: list[WriteResult] = []
        for n, bucket in enumerate(buckets):
            name = f"{prefix}{n}{DEFAULT_SUFFIX}"
            results += self._write_file(self.fs.concat_path(self.path, name), name, bucket, planner)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, path: Any, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """One data file: bytes items first, then tensors (DCP's order); each
        tensor raw (``schema.is_raw_entry``) or torch.saved, each digested."""
        ordered = ([w for w in items if w.type == WriteItemType.BYTE_IO]
                   + [w for w in items if w.type != WriteItemType.BYTE_IO])
        out = []
        with self.fs.create_stream(path, "wb") as stream:
            for w in ordered:
                start = stream.tell()
                data = planner.resolve_data(w)
                if w.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if schema.is_raw_entry(w.index.fqn):
                        # The chunk's bytes, row-major: its dtype and sizes are in .metadata.
                        stream.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
                    else:
                        if tensor.untyped_storage().size() != tensor.nbytes:
                            tensor = tensor.clone()  # as DCP: torch.save writes the whole storage
                        torch.save(tensor, stream)
                end = stream.tell()
                info = _StorageInfo(name, start, end - start)
                out.append(WriteResult(w.index, end - start, _Digested(info, stream.segments[(start, end)])))
            if self.sync_files:
                stream.flush()
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, OSError, io.UnsupportedOperation):
                    pass
        return out

    def storage_meta(self) -> StorageMeta | None:
        # DCP's finish writes this into .metadata: the mark that this save wrote .digests.
        meta = super().storage_meta() or StorageMeta()
        if self._ledger.hashing and digest_format.MARKER not in meta.modules:
            meta.modules.append(digest_format.MARKER)
        return meta

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        items: dict[str, dict[int, tuple[int, str]]] = {}
        plain = []
        for rank_results in results:
            kept = []
            for r in rank_results:
                if isinstance(r.storage_data, _Digested):
                    info = r.storage_data.info
                    if int(info.length):  # an empty item shares its offset with the next one (Digests.item)
                        items.setdefault(info.relative_path, {})[int(info.offset)] = (int(info.length),
                                                                                      r.storage_data.digest)
                    r = WriteResult(r.index, r.size_in_bytes, info)
                kept.append(r)
            plain.append(kept)
        # The rename of .metadata writes them (_DigestingFS.rename); .metadata
        # says so (storage_meta: digest_format.MARKER), so a load refuses it without them.
        self._ledger.items = items if self._ledger.hashing else None
        try:
            super().finish(metadata, plain)
        finally:
            self._ledger.items = None


class DigestingFileSystemWriter(_DigestWriting, FileSystemWriter):
    """DCP's ``FileSystemWriter`` that also writes ``.digests``."""


class DigestingFsspecWriter(_DigestWriting, FsspecWriter):
    """DCP's ``FsspecWriter`` (checkpoints at URLs) that also writes ``.digests``."""


