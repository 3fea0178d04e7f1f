"""The types of ``.metadata``'s fields, checked before any other code reads one.

``.metadata`` unpickles to DCP's dataclasses, but a pickle sets their fields
to whatever it holds: a declared size that is an int instead of a sequence,
a tensor entry without ``properties``, ``storage_data`` as a list, a size
nested a thousand tuples deep. Every later check (``load_checks``'
metadata stage, ``storage.stray_bytes``, the planners, ``export``'s
nesting from ``planner_data``) then fails with a ``TypeError``,
``AttributeError`` or ``RecursionError``, and in a multi-rank load it does
so on the rank that runs that check alone while the others wait in a
collective. So every reader checks the fields' types here first
(``reading.read_and_check_metadata``, which every rank runs on the same
bytes and so refuses on every rank together), against the shape DCP writes:
one pass, no recursion, each field read with a default (a crafted object
may lack any). Ranges (negative sizes, chunks outside their tensor, items
past their file) stay the metadata stage's (``load_checks``), which can
now rely on the types.

``planner_data`` (where each entry sits in the saved state dict, which
``export`` rebuilds) is bounded here too: at most ``MAX_PATH`` parts, each a
name or a list index no larger than the number of entries, and the list
slots all paths together make a rebuild grow at most ``MAX_SLOTS_PER_ENTRY``
per entry (each path alone in range, many deep ones could still grow
lists quadratic in the entries).
"""

from __future__ import annotations

from os import PathLike
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from gefen_titan.checkpoint.errors import GefenCheckpointError, fall_back
from gefen_titan.checkpoint.format import digests

__all__ = ["MalformedMetadataError", "MAX_DIMS", "MAX_PATH", "MAX_NAME", "MAX_SLOTS_PER_ENTRY", "problem", "check",
           "items_per_file"]

MAX_DIMS = 64  # dimensions of a declared tensor (torch's own limit for most kernels is 25)
MAX_PATH = 64  # parts of an entry's place in the saved state dict (torchtitan nests 2-4 deep)
MAX_NAME = 1 << 16  # characters of an entry's name, a file's name or a path
# List slots a rebuild of the nested state dict from planner_data may make, per entry (the sum over every
# path of its list indices + 1): torchtitan's lists (param groups, per-rank states) hold one entry a slot.
MAX_SLOTS_PER_ENTRY = 4
_MISSING = object()


class MalformedMetadataError(GefenCheckpointError):
    """A field of ``.metadata`` holds a type DCP never writes there."""

    check = "metadata fields"

    def __init__(self, checkpoint_id: str, what: str, message: str | None = None) -> None:
        self.checkpoint_id, self.what = checkpoint_id, what
        super().__init__(message or (
            f"checkpoint {checkpoint_id} is malformed: .metadata: {what} [metadata fields]. No save of gefen-titan "
            f"or torchtitan writes this (edited, or damaged): restore it from a copy or "
            f"{fall_back(checkpoint_id, digests.step_problem)}. Nothing was loaded."))

    def __reduce__(self) -> tuple:
        # Pickled to every rank by DCP's gather: keep the fields, and the message as worded, so a rank
        # that unpickles it does not check the older steps for its advice again.
        return type(self), (self.checkpoint_id, self.what, str(self)), self.__dict__


def _name(v: Any) -> bool:
    return type(v) is str and len(v) <= MAX_NAME


def _count(v: Any) -> bool:
    return type(v) is int


def _ints(v: Any, dims: int | None = None) -> bool:
    """A flat tuple (``torch.Size`` or plain) of ints, of ``dims`` entries if given."""
    if not isinstance(v, tuple) or len(v) > MAX_DIMS or (dims is not None and len(v) != dims):
        return False
    return all(type(x) is int for x in v)


def _field(obj: Any, name: str) -> Any:
    return getattr(obj, name, _MISSING)


def _tensor(key: str, md: TensorStorageMetadata) -> str | None:
    props, size, chunks = _field(md, "properties"), _field(md, "size"), _field(md, "chunks")
    if type(props) is not TensorProperties or not isinstance(_field(props, "dtype"), torch.dtype):
        return f"entry {key}: its properties are {type(props).__name__}, not TensorProperties with a dtype"
    if not _ints(size):
        return f"entry {key}: its size is {type(size).__name__}, not a flat tuple of ints of at most {MAX_DIMS}"
    if type(chunks) is not list:
        return f"entry {key}: its chunks are {type(chunks).__name__}, not a list"
    for c in chunks:
        if type(c) is not ChunkStorageMetadata:
            return f"entry {key}: a chunk is {type(c).__name__}, not ChunkStorageMetadata"
        if not (_ints(_field(c, "offsets"), len(size)) and _ints(_field(c, "sizes"), len(size))):
            return f"entry {key}: a chunk's offsets or sizes are not {len(size)} ints"
    return None


def _item(index: Any, info: Any) -> str | None:
    if type(index) is not MetadataIndex or not _name(_field(index, "fqn")):
        return f"storage_data holds a key of type {type(index).__name__}, not a MetadataIndex with a name"
    offset, at = _field(index, "offset"), _field(index, "index")
    if not (offset is None or _ints(offset)) or not (at is None or _count(at)):
        return f"entry {index.fqn}: an item's chunk offset is {type(offset).__name__}, not a tuple of ints"
    if type(info) is not _StorageInfo:
        return f"entry {index.fqn}: an item is {type(info).__name__}, not DCP's _StorageInfo"
    path, start, length = _field(info, "relative_path"), _field(info, "offset"), _field(info, "length")
    if not (_name(path) and _count(start) and _count(length)):
        return (f"entry {index.fqn}: an item's file, offset and length are {type(path).__name__}, "
                f"{type(start).__name__}, {type(length).__name__}, not a name and two ints")
    transforms = getattr(info, "transform_descriptors", None)  # DCP pickles _StorageInfo without its None fields
    if transforms is not None and not (isinstance(transforms, (list, tuple)) and all(_name(t) for t in transforms)):
        return f"entry {index.fqn}: an item's transforms are {type(transforms).__name__}, not a list of names"
    return None


def _planner_data(data: Any, entries: int) -> str | None:
    if type(data) is not dict:  # DCP's save planner always writes its mapping (empty for a flat state dict)
        return f"planner_data is {type(data).__name__}, not a dict"
    slots, bound = 0, MAX_SLOTS_PER_ENTRY * entries + MAX_PATH
    for key, path in data.items():
        if not _name(key) or not isinstance(path, tuple) or not 0 < len(path) <= MAX_PATH:
            return f"planner_data of {key!r:.80}: not a name and a tuple of 1 to {MAX_PATH} parts"
        for part in path:
            if not (_name(part) or (type(part) is int and 0 <= part <= entries)):
                return (f"planner_data of {key:.80}: a part {type(part).__name__} {part!r:.40}, neither a name nor "
                        f"a list index up to the {entries:,} entries")
            if type(part) is int:
                slots += part + 1  # a list index makes a rebuild (export) grow a list to it
        if slots > bound:
            return (f"planner_data's list indices would make a rebuild of the state dict grow lists by {slots:,} "
                    f"slots, more than {MAX_SLOTS_PER_ENTRY} per entry")
    return None


def _storage_meta(meta: Any) -> str | None:
    if meta is None:
        return None
    if type(meta) is not StorageMeta:
        return f"storage_meta is {type(meta).__name__}, not StorageMeta"
    ident = _field(meta, "checkpoint_id")
    if not (ident is None or _name(ident) or (isinstance(ident, PathLike) and len(str(ident)) <= MAX_NAME)):
        return f"storage_meta.checkpoint_id is {type(ident).__name__}"
    for name in ("save_id", "load_id"):
        if not (_field(meta, name) is None or _name(_field(meta, name))):
            return f"storage_meta.{name} is {type(_field(meta, name)).__name__}, not a name"
    modules = _field(meta, "modules")
    if not (isinstance(modules, list) and all(_name(m) for m in modules)):
        return f"storage_meta.modules is {type(modules).__name__}, not a list of names"
    return None


def problem(md: Any) -> str | None:
    """Why ``md`` is not metadata of the shape DCP writes (module docstring), or None."""
    if type(md) is not Metadata:
        return f"holds a {type(md).__name__}, not DCP's Metadata"
    entries, items = _field(md, "state_dict_metadata"), _field(md, "storage_data")
    if type(entries) is not dict:
        return f"state_dict_metadata is {type(entries).__name__}, not a dict"
    if type(items) is not dict:
        return f"storage_data is {type(items).__name__}, not a dict"
    for key, e in entries.items():
        if not _name(key):
            return f"state_dict_metadata holds a key of type {type(key).__name__}, not a name"
        if type(e) is TensorStorageMetadata:
            why = _tensor(key, e)
            if why:
                return why
        elif type(e) is not BytesStorageMetadata:
            return f"entry {key}: a {type(e).__name__}, neither a tensor's nor a byte entry's metadata"
    for index, info in items.items():
        why = _item(index, info)
        if why:
            return why
    version = _field(md, "version")
    if not (version is None or _name(version)):
        return f"version is {type(version).__name__}, not a name"
    return _planner_data(_field(md, "planner_data"), len(entries)) or _storage_meta(_field(md, "storage_meta"))


def check(md: Any, checkpoint_id: str) -> None:
    """``MalformedMetadataError`` unless ``problem(md)`` is None."""
    why = problem(md)
    if why:
        raise MalformedMetadataError(checkpoint_id, why)


def items_per_file(md: Metadata) -> dict[str, int]:
    """How many items ``md`` (checked) stores in each data file: the rows ``.digests`` may hold for it."""
    out: dict[str, int] = {}
    for info in md.storage_data.values():
        out[info.relative_path] = out.get(info.relative_path, 0) + 1
    return out

