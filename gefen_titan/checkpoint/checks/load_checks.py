"""The checks a load runs on what it reads, without a live model: one list, run by the load and the offline tools.

``gefen-titan ckpt verify`` promises that a checkpoint it passes is one the
resume accepts, and ``export`` and ``convert`` read what the resume reads.
That holds by construction only if they run the resume's own checks, so
every check a load makes of the checkpoint alone is named in ``CHECKS`` and
implemented once, here or where its stage's reader lives; the resume and the
tools call the same functions. ``tests/unit/test_load_checks.py`` plants one
violation for every name in ``CHECKS`` and shows that ``verify`` and the
resume give the same verdict; a new check without a planted case fails it.
What needs the live model (the parameters' shapes, the mesh's cuts, the
recipe) stays with the load (``optim.checkpointing``).

Stages, in the order a load meets them:

* ``read`` (``checkpoint.format.files``, ``pickle_budget``, ``metadata_fields``):
  every file opened as a regular file only, its size against its bound
  before it is read; every pickle's opcodes within their budgets before it
  is unpickled; ``.metadata``'s field types before any other check reads a
  field. A file refused here is not read further.
* ``digests`` (``checkpoint.format.digests``, ``reading``, ``storage.stray_bytes``):
  every stored byte against ``.digests``; ``.digests`` present where the save
  wrote one; no byte of a data file outside an item.
* ``metadata`` (``metadata_problems``): ``.metadata`` against the folder's
  file sizes, before any buffer is allocated or any read issued. A load
  runs it once (rank 0 of the manager's reader, ``reading.LoadChecks``; the
  verdict is agreed on every rank), ``storage.load_all`` (``export``) and the
  offline view (``ckpt_tools.view.Checkpoint``: ``inspect`` flags, ``convert``
  refuses, ``verify`` lists) before they read. The reader also checks each
  item against its file's size before it allocates the item's buffer.
* ``entry`` (``read_byte_entry``, ``stored_tensor_problem``): each stored item
  as it is read: byte entries unpickled with the allowlists only
  (``checkpoint.format.unpickling``), a data loader's pickled state inside one too,
  a torch.saved tensor against its chunk record, and the train state's step
  against the folder's (step binding). The reader runs them on the items of
  its plan and on the byte items no rank reads (``check_unread``).
* ``records`` (``checkpoint.checks.record_checks``): the optimizer's records and
  codebooks, on the load's one small read of them
  (``optim.checkpointing.load_context``; refused after the model-aware checks, so a
  checkpoint of another model is named as such first) and on the tools'
  (``ckpt_tools.saved_records``). What each kind checks is its own
  (``checkpoint.format.kinds.KindDescription.read``, registered with its registry
  entry); the stage runs every registered kind's and names none.

Cost: the metadata stage is one pass over ``.metadata``'s entries and items
and one size per data file (rank 0, once per load): 4.6 ms for a 150M
Llama's 2-rank save (336 entries, 669 items; 2026-12-05, this VM), against
a ~85 ms load; paired in one process (``scripts/bench_checkpoint.py --model
150M --methods checks,adamw``), +1.4% median, zero inside its 95% interval
(``docs/checkpoints.md``). The entry stage adds a dictionary lookup per item and, for
the few byte entries, what their unpickling costs (they are KBs).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from gefen_titan.checkpoint.checks import entry_values, record_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError, fall_back
from gefen_titan.checkpoint.format import digests, schema, unpickling

__all__ = ["Check", "CHECKS", "Problem", "StepMismatchError", "metadata_problems", "allocation", "refusal",
           "item_past_end",
           "read_byte_entry", "stored_tensor_problem", "folder_step", "read_records", "record_problems",
           "is_loader_state"]


@dataclass(frozen=True)
class Check:
    name: str
    stage: str
    refuses: str


CHECKS: tuple[Check, ...] = (
    Check("regular files", "read", "a file of the folder that is a FIFO, a device or a directory, or larger than "
                                   "the format or its save allows (checked on its descriptor before reading)"),
    Check("pickle budgets", "read", "a pickle (.metadata, a byte entry, a loader's state) nested too deep, sharing "
                                    "too much, too many or too long objects, or a compressed zip member"),
    Check("metadata fields", "read", "a field of .metadata of a type DCP never writes there"),
    Check("digests", "digests", "a stored byte, .metadata or .digests that differs from what the save wrote"),
    Check("digests present", "digests", "a folder without the .digests its .metadata says the save wrote"),
    Check("stray bytes", "digests", "bytes of a data file outside every item, a data file .metadata does not list"),
    Check("chunks inside tensors", "metadata", "a chunk outside its tensor, a negative or non-integer size"),
    Check("chunks tile", "metadata", "chunks that overlap or leave part of their tensor uncovered"),
    Check("chunks stored", "metadata", "a chunk or byte entry without its stored item, an item of no entry"),
    Check("items inside files", "metadata", "an item past the end of its file (file-system sizes), items that "
                                            "overlap, a file name outside the folder"),
    Check("item sizes", "metadata", "an item whose length does not match its chunk's sizes and dtype"),
    Check("allocation", "metadata", "entries whose reads would allocate more than the data files hold"),
    Check("byte entries", "entry", "a byte entry whose pickle names a global outside the allowlist"),
    Check("loader states", "entry", "a data loader's pickled state that names any global"),
    Check("stored tensors", "entry", "a torch.saved tensor item of another dtype or shape than its chunk"),
    Check("step binding", "entry", "train_state.step other than the step its folder is named for"),
    Check("entry values", "entry", "a train state, LR scheduler or data loader value of a type or range no save "
                                   "writes (entry_values: a step beyond 2^53, a position of 81 bits)"),
    Check(record_checks.RECORDS, "records", "records that do not parse, or whose counters, hyperparameters or "
                                            "periods their optimizer kind cannot have"),
    Check(record_checks.RECORD_TENSORS, "records", "a tensor a record implies missing or of another shape or "
                                                   "dtype, a state tensor of no record, or an entry of a kind "
                                                   "this version does not know"),
    Check(record_checks.CODEBOOKS, "records", "an invalid codebook, two codebooks of one job, state without one"),
)
_STAGES = {c.name: c.stage for c in CHECKS}


@dataclass(frozen=True)
class Problem:
    check: str  # a name of CHECKS
    file: str | None  # the checkpoint file it is in (None: not tied to one)
    entry: str | None  # the DCP entry (flat key)
    what: str

    def __post_init__(self) -> None:
        if self.check not in _STAGES:
            raise ValueError(f"{self.check!r} is no check of load_checks.CHECKS")

    def __str__(self) -> str:
        where = ": ".join(x for x in (self.file, self.entry) if x)
        return f"{where}: {self.what}" if where else self.what


class StepMismatchError(GefenCheckpointError):
    """A checkpoint's train state says another step than its folder's name (step binding)."""


def refusal(checkpoint_id: str, problems: list[Problem]) -> str:
    """The message a load raises for ``problems`` (the first three, and how many)."""
    shown = "; ".join(f"{p} [{p.check}]" for p in problems[:3])
    more = f" (and {len(problems) - 3} more: `gefen-titan ckpt verify {checkpoint_id}` lists them)" \
        if len(problems) > 3 else ""
    when = (" It was refused before any buffer was allocated or any data byte read."
            if all(_STAGES[p.check] == "metadata" for p in problems) else "")
    return (f"checkpoint {checkpoint_id} is malformed: {shown}{more}.{when} No save of gefen-titan or torchtitan "
            f"writes this (edited, or damaged): restore it from a copy or "
            f"{fall_back(checkpoint_id, digests.step_problem)}. Nothing was loaded.")


# ------------------------------------------------------------------ metadata
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


# ------------------------------------------------------------------ entries
_LOADER_STATE = re.compile(r"dataloader\.dp_rank_\d+")  # torchtitan pickles one loader state per DP rank there
_STEP_ENTRY = "train_state.step"
_STEP_FOLDER = re.compile(r"step-(\d+)")


def is_loader_state(key: str) -> bool:
    return bool(_LOADER_STATE.fullmatch(key))


def folder_step(checkpoint_id: str) -> int | None:
    """The step a checkpoint folder is named for (torchtitan's ``step-N``); None for another name."""
    m = _STEP_FOLDER.fullmatch(os.path.basename(str(checkpoint_id).rstrip("/")))
    return int(m.group(1)) if m else None


def read_byte_entry(data: Any, key: str, checkpoint_id: str) -> Any:
    """A byte entry's value, read as every load reads it (``unpickling.load_entry``), after the entry
    stage's checks of it: a data loader's pickled state inside it plain data only
    (``ForbiddenObjectError``), and ``train_state.step`` the step of its folder (``StepMismatchError``).
    Then its value's type and range (``entry_values``: ``EntryValueError``), for the known entries of
    torchtitan's train state, LR schedulers and data loaders. Other unpickling errors (damaged bytes) propagate."""
    value = unpickling.load_entry(data, key, checkpoint_id)
    if is_loader_state(key) and isinstance(value, (bytes, bytearray)):
        state = unpickling.loads_loader_state(bytes(value), key, checkpoint_id)
        entry_values.check_loader_state(state, key, checkpoint_id)
    entry_values.check(key, value, checkpoint_id)  # before the step binding: a step of 2^63 is named as such
    if key == _STEP_ENTRY:
        folder = folder_step(checkpoint_id)
        if folder is not None and (type(value) is not int or value != folder):
            # Binding the step is cheap; binding the run is not (docs/checkpoints.md, threat model).
            raise StepMismatchError(
                f"checkpoint {checkpoint_id}: its train_state.step is {value!r}, and its folder is step-{folder}: "
                "a checkpoint's files moved to another step's folder (a replay of an older step?) or edited. "
                f"Resume from a checkpoint whose folder matches its step; nothing was loaded.")
    return value


def stored_tensor_problem(key: str, value: Any, dtype: Any, sizes: tuple[int, ...]) -> str | None:
    """Why a torch.saved tensor item is not its chunk (``dtype``, ``sizes`` from ``.metadata``), or None."""
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != tuple(sizes):
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        return f"entry {key}: its stored chunk is {got}, its .metadata says {dtype} {tuple(sizes)}"
    return None


# ------------------------------------------------------------------ records
def read_records(entries: dict[str, Any], small: dict[str, Any], prefix: str = "optimizer."
                 ) -> tuple[record_checks.SavedRecords | None, list[Problem]]:
    """The records stage: ``entries`` the optimizer component's (names inside it -> DCP metadata),
    ``small`` the values of its small entries (``record_checks.small_names``); the records it parsed
    (None: no header, or an unreadable one, which is a ``records`` problem) and its problems."""
    try:
        saved = record_checks.read_saved(entries, small)
    except schema.FormatError as e:
        return None, [Problem(record_checks.RECORDS, None, prefix + schema.header_key(), str(e))]
    if saved is None:
        return None, []
    return saved, [Problem(check, None, prefix + name, what) for check, name, what in saved.checked]


def record_problems(entries: dict[str, Any], small: dict[str, Any], prefix: str = "optimizer.") -> list[Problem]:
    """The records stage's problems (``read_records``)."""
    return read_records(entries, small, prefix)[1]
