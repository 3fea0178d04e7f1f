"""The metadata stage of ``load_checks``: ``.metadata`` against the folder's file sizes, before any
buffer is allocated or any data byte read.

A crafted ``.metadata`` can claim a 2^50-element tensor, an item 8 GiB past
its file's end, or 200,000 chunks of one tensor; a reader that trusted it
would allocate what it claims. So every read is bounded by the data files'
own sizes (the file system's, not ``.metadata``'s) before it is planned: each
chunk inside its tensor, chunks that tile it once, every chunk and byte
entry stored and every item an entry's, every item inside its file and as
long as its chunk's sizes and dtype need, and a full read's allocation
within the files' bytes. Its checks are named in ``load_checks.CHECKS``
(stage ``metadata``) and its problems are ``load_checks.Problem``; kept
apart from that list because it is most of the checks' code. Who runs it
and what it costs: ``load_checks``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from gefen_titan.checkpoint.checks.load_checks import Problem
from gefen_titan.checkpoint.format import schema

__all__ = ["allocation", "metadata_problems", "item_past_end"]

_DATA_FILE = re.compile(r"[\w][\w.-]*")  # a file of the folder itself: no separator, no "..", not hidden


def _itemsize(dtype: Any) -> int | None:
    if not isinstance(dtype, torch.dtype):
        return None
    return dtype.itemsize


def _count(v: Any) -> bool:
    """A non-negative Python int (a crafted pickle may hold anything where DCP writes one; ``type`` is:
    no bool, and the restricted unpickling builds no other int subclass)."""
    return type(v) is int and v >= 0


def _ints(values: Any) -> tuple[int, ...] | None:
    try:
        out = tuple(values)
    except TypeError:
        return None
    for v in out:
        if type(v) is not int or v < 0:
            return None
    return out


def allocation(metadata: Metadata) -> int:
    """Bytes a reader that reads every entry whole allocates: each tensor's elements at its dtype, each
    byte entry's stored items (what ``storage.load_all`` and a full offline read hold)."""
    total = 0
    for md in metadata.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            size = _ints(md.size)
            total += (math.prod(size) if size is not None else 0) * (_itemsize(md.properties.dtype) or 0)
    byte_keys = {k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    total += sum(info.length for index, info in metadata.storage_data.items() if index.fqn in byte_keys
                 and _count(getattr(info, "length", None)))
    return total


def metadata_problems(metadata: Metadata, size_of: Callable[[str], int | None]) -> list[Problem]:
    """Every problem of the metadata stage (empty: the reads it implies are bounded by the files).

    ``size_of(name)``: a data file's size from the file system (None: missing). No tensor is allocated
    and no data byte is read.
    """
    out: list[Problem] = []
    add = out.append
    entries = metadata.state_dict_metadata
    stored: dict[str, dict[Any, Any]] = {}
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        # getattr: DCP's _StorageInfo pickles without its None fields, so a crafted one may lack any
        file, key = getattr(info, "relative_path", None), index.fqn
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(file, str) or not _DATA_FILE.fullmatch(file) or file in (".metadata", ".digests"):
            add(Problem("items inside files", None, key, f"its item names {file!r}, which is no data file of the "
                                                         "folder"))
            continue
        if not (_count(offset) and _count(length)):
            add(Problem("items inside files", file, key, f"item at offset {offset!r} of length {length!r}: not "
                                                         "a place in a file"))
            continue
        chunk = None if index.offset is None else _ints(index.offset)
        stored.setdefault(key, {})[chunk] = info
        by_file.setdefault(file, []).append((offset, length, key))
        if key not in entries:
            add(Problem("chunks stored", file, key, "the metadata stores data for an entry it does not describe"))
    for file, items in sorted(by_file.items()):
        size = size_of(file)
        if size is None:
            add(Problem("items inside files", file, items[0][2], f"cannot read it: file missing ({len(items)} items "
                                                                 "are stored in it)"))
            continue
        end, last = 0, None
        for offset, length, key in sorted(items):
            past = item_past_end(file, key, offset, length, size)
            if past:
                add(past)
            elif offset < end and length:
                add(Problem("items inside files", file, key, f"item at byte {offset:,} overlaps {last}'s, which "
                                                             f"ends at {end:,}"))
            if offset + length > end:
                end, last = offset + length, key
    for key, md in entries.items():
        items = stored.get(key, {})
        if isinstance(md, BytesStorageMetadata):
            if None not in items:
                add(Problem("chunks stored", None, key, "no stored item for this byte entry"))
            continue
        if not isinstance(md, TensorStorageMetadata):
            add(Problem("chunks inside tensors", None, key, f"an entry of type {type(md).__name__}"))
            continue
        out += _tensor_problems(key, md, items, len(by_file))
    total, files = allocation(metadata), sum(size_of(f) or 0 for f in by_file)
    if total > files:
        add(Problem("allocation", None, None, f"reading every entry would allocate {total:,} bytes, and the data "
                                              f"files hold {files:,}"))
    return out


def item_past_end(file: str, entry: str, offset: int, length: int, size: int) -> Problem | None:
    """The "items inside files" check of one item against its file's size (the file system's): the
    metadata stage runs it on every item, and the reader again on each item before it allocates its
    buffer (the file may have changed since)."""
    if offset + length <= size:
        return None
    return Problem("items inside files", file, entry, f"cannot read item [{offset:,}, {offset + length:,}): it lies "
                                                      f"past the end of its file ({size:,} bytes; truncated?)")


def _tensor_problems(key: str, md: TensorStorageMetadata, items: dict[Any, Any], files: int) -> list[Problem]:
    out: list[Problem] = []
    if len(md.chunks) > max(files, 1):
        # A save writes at most one chunk of an entry per rank (a DTensor's local shard), and every rank
        # writes at least one data file: more chunks than data files is no save's layout, and bounds the
        # tiling check below by the files (200,000 chunks of one small tensor held a rank for minutes).
        return [Problem("chunks tile", None, key, f"{len(md.chunks):,} chunks, and the save wrote {files:,} data "
                                                  "file(s) (each rank writes one chunk of an entry)")]
    shape, itemsize = _ints(md.size), _itemsize(md.properties.dtype)
    if shape is None or itemsize is None:
        return [Problem("chunks inside tensors", None, key, f"size {tuple(md.size)!r} of dtype "
                                                            f"{md.properties.dtype!r}: not a tensor's")]
    chunks = []
    may_be_raw = schema.is_raw_entry(key)
    for c in md.chunks:
        offsets, sizes = _ints(c.offsets), _ints(c.sizes)
        if (offsets is None or sizes is None or len(offsets) != len(shape) or len(sizes) != len(shape)
                or any(o + s > n for o, s, n in zip(offsets, sizes, shape))):
            out.append(Problem("chunks inside tensors", None, key, f"chunk at {tuple(c.offsets)} of size "
                                                                   f"{tuple(c.sizes)} lies outside {shape}"))
            continue
        chunks.append((offsets, sizes))
        info = items.get(offsets)
        if info is None:
            out.append(Problem("chunks stored", None, key, f"no stored item for its chunk at {offsets}"))
            continue
        nbytes = math.prod(sizes) * itemsize
        raw = may_be_raw and info.length == nbytes
        if not raw and info.length < nbytes:  # a torch.saved chunk holds its bytes and a frame around them
            out.append(Problem("item sizes", info.relative_path, key, f"its item at {offsets} has {info.length:,} "
                                                                      f"bytes, and {sizes} of {md.properties.dtype} "
                                                                      f"need {nbytes:,}"))
    for offsets in items:
        if offsets is None or all(offsets != o for o, _ in chunks):
            info = items[offsets]
            if len(chunks) == len(md.chunks):
                out.append(Problem("chunks stored", info.relative_path, key, f"stored item at {offsets} is no chunk "
                                                                             "of the entry"))
    if len(chunks) == len(md.chunks):
        why = _cover_once(shape, chunks)
        if why:
            out.append(Problem("chunks tile", None, key, why))
    return out


_PAIRWISE = 64  # chunks per tensor up to which overlaps are found pair by pair (else on a grid of cells)


def _cover_once(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """None if the chunks cover every element of the tensor exactly once."""
    if not shape:
        return None if len(chunks) == 1 else f"{len(chunks)} chunks for a scalar"
    numel = math.prod(shape)
    held = sum(math.prod(s) for _, s in chunks)
    if held != numel:
        return f"its chunks hold {held:,} elements of its {numel:,}"
    if numel == 0:
        return None
    boxes = [(o, s) for o, s in chunks if all(s)]  # an empty chunk holds nothing
    if len(boxes) <= _PAIRWISE:
        # Inside the tensor (checked before), pairwise disjoint and holding all its elements: they
        # tile it. One pair at a 2-rank save: what a load pays for this check.
        for i, (a, sa) in enumerate(boxes):
            for b, sb in boxes[i + 1:]:
                if all(x < y + t and y < x + u for x, u, y, t in zip(a, sa, b, sb)):
                    return "its chunks overlap"
        return None
    cuts = [sorted({0, n} | {o[d] for o, _ in chunks} | {o[d] + s[d] for o, s in chunks}) for d, n in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > 1 << 24:  # too many cells to count: sorted disjoint boxes suffice
        boxes = sorted(chunks)
        for (a, sa), (b, _) in zip(boxes, boxes[1:]):
            if all(x <= y < x + s for x, y, s in zip(a, b, sa)):
                return "its chunks overlap"
        return None
    count = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    # A cut's cell index by a dict, not list.index: a list search per chunk made this quadratic in the chunk
    # count (200,000 one-element chunks of one tensor held a rank here for minutes while the others timed out).
    where = [{v: i for i, v in enumerate(c)} for c in cuts]
    for off, size in chunks:
        if all(size):
            count[tuple(slice(w[o], w[o + s]) for w, o, s in zip(where, off, size))] += 1
    if (count > 1).any():
        return "its chunks overlap"
    if (count == 0).any():
        return "its chunks leave part of the tensor uncovered"
    return None
