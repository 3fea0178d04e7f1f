"""Where checkpoints are read from: local folders and fsspec URLs alike.

torchtitan 0.3.0 writes checkpoints to local paths or to fsspec URLs
(``s3://``, ``gs://``, ``file://``, ...; ``torchtitan.tools.filesystem``) and
DCP picks its storage from the checkpoint id. Every reader gefen-titan makes
(the checkpoint manager's one reader per load, ``load_reader``, which its
``dcp.load`` is handed; the small header and record reads; the ``ckpt``
tools) comes from here, so it sees the same storage torchtitan wrote to. The ``ckpt`` tools also read a
checkpoint's files byte for byte (``list_files``, ``file_size``,
``open_file``) and write converted checkpoints (``storage_writer``).

Every writer made here is ``gefen_titan.checkpoint.io.writing``'s (format v3's
raw entries; ``.digests``, a digest of every stored byte), every reader
``gefen_titan.checkpoint.io.reading``'s (checks ``.metadata`` before unpickling
it and every item before it is used; reads raw entries).
"""

from __future__ import annotations

import functools
import os
import posixpath
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torchtitan.tools import filesystem

from gefen_titan.checkpoint.checks import load_checks, metadata_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError, unreadable
from gefen_titan.checkpoint.format import digests, files
from gefen_titan.checkpoint.format.digests import Digests
from gefen_titan.checkpoint.io.reading import CheckedFileSystemReader, CheckedFsspecReader, LoadChecks
from gefen_titan.checkpoint.io.writing import DigestingFileSystemWriter, DigestingFsspecWriter

__all__ = ["is_remote", "load_all", "load_reader", "stray_bytes", "metadata_problems",
           "read_metadata", "read_checked_metadata", "read_digests", "read_small",
           "storage_reader", "storage_writer", "list_files", "file_size", "open_file", "join", "refusal"]


def is_remote(checkpoint_id: str | os.PathLike) -> bool:
    """Whether ``checkpoint_id`` is an fsspec URL (torchtitan's rule)."""
    return filesystem.is_remote(checkpoint_id)


def storage_reader(checkpoint_id: str | os.PathLike, **checks: Any) -> CheckedFileSystemReader:
    """A checking DCP reader for a checkpoint folder: fsspec for URLs, the file system otherwise.

    ``checks`` (``metadata``, ``digests``, ``check_unread``, ``load_checks``): see
    ``reading._CheckedReading``. The load's targets must not be live state:
    a rank writes its targets before it learns of another rank's refusal.
    """
    checkpoint_id = os.fspath(checkpoint_id)
    if is_remote(checkpoint_id):
        return CheckedFsspecReader(checkpoint_id, **checks)
    return CheckedFileSystemReader(checkpoint_id, **checks)


def load_reader(checkpoint_id: str | os.PathLike, *, load_without_digests: bool = False) -> CheckedFileSystemReader:
    """The one reader of a checkpoint manager's load, handed to ``dcp.load``: it reads and checks
    ``.metadata`` once (``reading.LoadChecks``: also a missing ``.digests``, stray bytes) for
    the components that plan from it and for DCP alike, and checks every stored item."""
    checkpoint_id = os.fspath(checkpoint_id)
    checks = LoadChecks(load_without_digests=load_without_digests,
                        stray_bytes=functools.partial(stray_bytes, checkpoint_id),
                        bounds=functools.partial(metadata_problems, checkpoint_id))
    return storage_reader(checkpoint_id, check_unread=True, load_checks=checks)


def metadata_problems(checkpoint_id: str | os.PathLike, metadata: Metadata) -> list[load_checks.Problem]:
    """``metadata_checks.metadata_problems`` of a checkpoint: its ``.metadata`` against its data files' sizes
    (one size per data file), before anything is allocated or read."""
    sizes: dict[str, int | None] = {}

    def size_of(name: str) -> int | None:
        if name not in sizes:
            sizes[name] = file_size(checkpoint_id, name)
        return sizes[name]

    return metadata_checks.metadata_problems(metadata, size_of)


def read_metadata(checkpoint_id: str | os.PathLike) -> Metadata:
    """The checkpoint's DCP metadata (``.metadata``), checked against ``.digests`` when it has one.

    Raises OSError for a missing file, ``GefenCheckpointError``
    (``digests.CorruptCheckpointError``) for damaged bytes.
    """
    return read_checked_metadata(checkpoint_id)[0]


def read_checked_metadata(checkpoint_id: str | os.PathLike) -> tuple[Metadata, Digests | None]:
    """``read_metadata`` and the checkpoint's ``.digests`` (None: written without digests, loads unchecked)."""
    reader = storage_reader(checkpoint_id)
    metadata = reader.read_metadata()
    return metadata, reader.digests()


def read_digests(checkpoint_id: str | os.PathLike) -> Digests | None:
    """The checkpoint's ``.digests`` (None: it has none); ``CorruptCheckpointError`` if its header or
    index is damaged (a section: when an item of its file is first asked for, or ``Digests.check``)."""
    if file_size(checkpoint_id, digests.FILE) is None:
        return None
    return digests.read(lambda: open_file(checkpoint_id, digests.FILE), os.fspath(checkpoint_id))


def read_small(checkpoint_id: str, metadata: Metadata, prefix: str, tensors: list[str],
               strings: list[str]) -> dict[str, Any]:
    """One small ``dcp.load`` of the named entries (keys without ``prefix``).

    Collective: every rank calls it with the same keys; an unreadable file
    or a damaged byte raises the same ``GefenCheckpointError`` on every rank
    (DCP raises its exception on all of them). Its targets are new
    tensors, as the checking reader requires (``checkpoint.io.reading``).
    """
    if not tensors and not strings:  # the same on every rank: they all skip the read
        return {}
    md = metadata.state_dict_metadata
    small: dict[str, Any] = {prefix + k: torch.empty(md[prefix + k].size, dtype=md[prefix + k].properties.dtype)
                             for k in tensors}
    small.update({prefix + k: "" for k in strings})
    try:
        dcp.load(small, storage_reader=storage_reader(checkpoint_id, metadata=metadata))
    except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps the cause
        raise refusal(checkpoint_id, e) from e
    return {k[len(prefix):]: v for k, v in small.items()}


def load_all(checkpoint_id: str | os.PathLike) -> dict[str, Any]:
    """Every entry of a checkpoint, nested as it was saved, in this process
    (DCP's ``format_utils.dcp_to_torch_save`` reads through DCP's own reader,
    which refuses format v3's raw entries; this one reads them, and checks
    ``.digests``). The whole checkpoint in memory: for tools and tests."""
    sd: dict[str, Any] = {}
    metadata, record = read_checked_metadata(checkpoint_id)  # its own errors, not DCP's wrapping of them
    problems = metadata_problems(checkpoint_id, metadata)  # its planner allocates every entry whole: bounded first
    if problems:
        raise GefenCheckpointError(load_checks.refusal(os.fspath(checkpoint_id), problems))
    # What dcp_to_torch_save calls (dcp.load would hand back only the keys it was given).
    try:
        _load_state_dict(sd, storage_reader=storage_reader(checkpoint_id, metadata=metadata, digests=record),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps the cause
        raise refusal(os.fspath(checkpoint_id), e) from e
    return sd


def stray_bytes(checkpoint_id: str | os.PathLike, metadata: Metadata) -> list[tuple[str, str]]:
    """(file, what) for every byte of the folder's data files that no item covers: a data file longer
    than its items reach, bytes between two items, or a ``.distcp`` file ``.metadata`` does not list.

    A checkpoint with ``.digests`` has every byte of its data files in one
    item (``digests`` module docstring), so anything else was put there
    after the save. One listing and one size per data file.
    """
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        if type(getattr(info, "offset", None)) is not int or type(getattr(info, "length", None)) is not int:
            continue  # not a place in a file: the metadata stage's to name (metadata_checks)
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, index.fqn))
    found = []
    for name in list_files(checkpoint_id):
        if name.endswith(".distcp") and name not in spans:
            found.append((name, "a data file .metadata does not list (added after the save?)"))
    for name, items in sorted(spans.items()):
        end, last = 0, None
        for start, stop, key in sorted(items):
            if start > end:  # a save writes its items back to back: a gap is an item cut short since
                where = f"the end of entry {last}'s item, shortened" if last else "before its first item, moved"
                found.append((name, f"{start - end:,} bytes at byte {end:,} lie in no item ({where} after the "
                                    "save?)"))
                break
            if stop >= end:  # ties: the later item (one cut to 0 bytes is named)
                end, last = stop, key
        size = file_size(checkpoint_id, name)
        if size is not None and size > end:
            found.append((name, f"{size - end:,} bytes after its last item (appended after the save?)"))
    return found


def refusal(checkpoint_id: str, error: Exception) -> GefenCheckpointError:
    """The error every rank raises for a failed collective read: a damaged
    byte's own message (raised by the readers on every rank together, and
    wrapped by DCP in a CheckpointException), else ``unreadable``."""
    if isinstance(error, GefenCheckpointError):
        return GefenCheckpointError(str(error))
    for failure in (getattr(error, "failures", None) or {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, GefenCheckpointError):
            return GefenCheckpointError(str(cause))
    return unreadable(checkpoint_id, error, digests.step_problem)


def storage_writer(checkpoint_id: str | os.PathLike, digests: bool = True,
                   key: bytes | None = None) -> DigestingFileSystemWriter:
    """A DCP writer for a new checkpoint folder (fsspec for URLs): format v3's
    raw entries, and ``.digests`` (``digests=False``: none, for benchmarks
    that measure what they cost; ``key``: keyed digests, a MAC)."""
    checkpoint_id = os.fspath(checkpoint_id)
    if is_remote(checkpoint_id):
        return DigestingFsspecWriter(checkpoint_id, digests=digests, key=key)
    return DigestingFileSystemWriter(checkpoint_id, digests=digests, key=key)


def join(checkpoint_id: str | os.PathLike, name: str) -> str:
    """``name`` inside a checkpoint folder (``/``-joined for URLs)."""
    checkpoint_id = os.fspath(checkpoint_id)
    return posixpath.join(checkpoint_id, name) if is_remote(checkpoint_id) else os.path.join(checkpoint_id, name)


def list_files(checkpoint_id: str | os.PathLike) -> list[str]:
    """Names in a checkpoint folder (``.metadata`` included); OSError if it is no folder."""
    checkpoint_id = os.fspath(checkpoint_id)
    if not filesystem.isdir(checkpoint_id):
        raise FileNotFoundError(f"{checkpoint_id} is not a checkpoint folder")
    return sorted(filesystem.listdir(checkpoint_id))


def file_size(checkpoint_id: str | os.PathLike, name: str) -> int | None:
    """Size in bytes of a file of the checkpoint, None if it does not exist (``files.NotARegularFileError``
    if it is no regular file)."""
    path = join(checkpoint_id, name)
    if is_remote(path):
        fs, p = url_to_fs(path)
        return int(fs.size(p)) if fs.exists(p) else None
    return files.regular_size(path)  # NotARegularFileError for a FIFO, a device, a directory


def open_file(checkpoint_id: str | os.PathLike, name: str) -> BinaryIO:
    """A binary read stream on a file of the checkpoint (a regular file only: ``checkpoint.format.files``)."""
    path = join(checkpoint_id, name)
    if is_remote(path):
        fs, p = url_to_fs(path)
        return fs.open(p, "rb")
    return files.open_regular(path)[0]
