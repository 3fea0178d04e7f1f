"""DCP storage readers that check ``.digests`` before anything is used, and read v3's raw entries.

**Metadata.** ``read_metadata`` checks ``.metadata``'s bytes before
unpickling them (a flipped byte never reaches ``pickle``). A checkpoint
manager's load makes one reader (``LoadChecks``): it reads and checks
``.metadata`` once, also refusing a checkpoint whose ``.digests`` is missing
or whose folder holds bytes no item covers, and every later use (the
manager's components planning their load, DCP's own ``read_metadata``)
gets that same checked metadata, or that same refusal.

**Items.** ``read_data`` reads every item this rank's plan needs, checks
each digest, and only then deserializes them into the planner's targets
(the reading, checking and decoding of items: ``item_reads.ItemReads``). A
damaged item raises on its rank before any of its targets is written, and
DCP's own gather after the read step raises it on every rank, so a refusal
costs no collective of ours. The targets must not be live state: a rank
whose own bytes are intact writes its targets before it learns of another
rank's refusal. Every caller hands fresh ones (the checkpoint manager reads
the model's entries into fresh tensors and applies them after the load;
the optimizer container stages its state; ``storage.read_small`` reads
into new tensors). Whether the checkpoint has ``.digests`` is agreed for
free in the planning round DCP makes anyway: each rank reads it in
``prepare_local_plan`` (an unreadable one raises there, and DCP raises that
on every rank) and says whether it found one; the coordinator refuses
ranks that disagree. A raw item (its key says so:
``schema.is_raw_entry``; ``checkpoint.io.writing``) is viewed where
it was read, its dtype and sizes taken from its chunk record in
``.metadata``, so checking it costs the hash and no copy; a torch.saved one
goes through ``torch.load`` as DCP does it. With ``check_unread`` the
coordinator also hands every stored item that no rank's plan reads
(another rank's data-loader entries, an excluded component) to the rank
with the fewest such bytes, so each load checks every item of the
checkpoint once. Cost: one xxh3 pass over the bytes read, and the rank's
items held in memory between the read and the commit (DCP holds one at a
time). A checkpoint without ``.digests`` is read the same way without the
digests. Byte entries are unpickled by ``unpickling.load_entry``
(``weights_only``), never by the planner's ``torch.load(weights_only=False)``,
and ``.metadata`` by ``unpickling.unpickle_metadata``.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.futures import Future
from torchtitan.tools.logging import logger

from gefen_titan.checkpoint.checks import load_checks, metadata_fields
from gefen_titan.checkpoint.errors import GefenCheckpointError, root_cause, unreadable
from gefen_titan.checkpoint.format import digest_format, files, unpickling
from gefen_titan.checkpoint.format import digests as dg
from gefen_titan.checkpoint.io.item_reads import ItemReads, load_bytes

__all__ = ["CheckedFileSystemReader", "CheckedFsspecReader", "LoadChecks", "read_and_check_metadata"]

_UNSET: Any = object()
# The largest .metadata a reader reads (when .digests records its size, that exact size). DCP's metadata is
# ~200 bytes per stored item: 1 GiB is ~5 million items, a save of 1,024 ranks with 5,000 entries each.
MAX_METADATA_BYTES = 1 << 30


# ------------------------------------------------------------------ load
def read_and_check_metadata(fs: Any, path: Any, checkpoint_id: str) -> tuple[Metadata, dg.Digests | None]:
    """``.metadata`` checked against ``.digests`` (when there is one), then unpickled
    with DCP's metadata classes only (``unpickling``).

    Raises ``digests.CorruptCheckpointError`` for damaged bytes,
    ``unpickling.ForbiddenObjectError`` for a pickle that names other
    globals, OSError when a file cannot be read.
    """
    digest_path = fs.concat_path(path, dg.FILE)
    record = dg.read(lambda: files.open_stream(fs, digest_path), checkpoint_id) if fs.exists(digest_path) else None
    if record is None and dg.current_key() is not None:  # nothing unpickled before the MAC is checked
        raise dg.CorruptCheckpointError(dg.corrupt_message(
            checkpoint_id, dg.FILE, None, "missing, and a key is set (checkpoint.digest_key_env): a checkpoint "
            "without its MAC is refused"), dg.FILE)
    name = str(fs.concat_path(path, dg.METADATA_FILE))
    with files.open_sized(fs, fs.concat_path(path, dg.METADATA_FILE)) as (f, size):
        if record is not None and size != record.metadata_size:  # before a byte of it is read
            record.check_metadata(b"", checkpoint_id, size=size)
        raw = files.read_whole(f, size, MAX_METADATA_BYTES, name, "the format (MAX_METADATA_BYTES)")
    if record is not None:
        record.check_metadata(raw, checkpoint_id)
    try:
        # Within budgets (unpickling.unpickle_metadata: nesting, copies): a pickle of allowed types only can
        # still crash or exhaust a reader while it is unpickled.
        metadata = unpickling.unpickle_metadata(raw, checkpoint_id)
        if not isinstance(metadata, Metadata):
            raise TypeError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    except GefenCheckpointError:  # ForbiddenObjectError, OverBudgetError: their own messages
        raise
    except Exception as e:  # any unpickling failure of damaged bytes
        raise dg.CorruptCheckpointError(dg.corrupt_message(
            checkpoint_id, dg.METADATA_FILE, None, f"does not unpickle ({root_cause(e)})"), dg.METADATA_FILE) from e
    # Field types before any other code reads a field (metadata_fields): then no check can fail with a
    # TypeError on one rank alone.
    metadata_fields.check(metadata, checkpoint_id)
    if record is not None:
        record.limit_rows(metadata_fields.items_per_file(metadata))
    return metadata, record


@dataclasses.dataclass(frozen=True)
class LoadChecks:
    """What a checkpoint manager's load checks of the checkpoint as a whole, on top of every byte.

    ``load_without_digests``: load a checkpoint whose ``.metadata`` says its
    save wrote ``.digests`` (``digest_format.expects_digests``) without one, unchecked
    (off: refused). ``stray_bytes``: ``storage.stray_bytes`` of the checkpoint,
    (file, what) for each byte no item covers; run on rank 0 only (the same
    files for every rank), and only for a checkpoint with ``.digests``.
    ``bounds``: ``metadata_checks.metadata_problems`` of the checkpoint (its files'
    sizes bound every read), rank 0 only, with digests or without.
    """

    load_without_digests: bool = False
    stray_bytes: Callable[[Metadata], list[tuple[str, str]]] | None = None
    bounds: Callable[[Metadata], list[load_checks.Problem]] | None = None


@dataclasses.dataclass(frozen=True)
class _Found:
    """A rank's local plan's note to the coordinator: whether it found ``.digests``."""

    digests: bool


def _failed_check(checkpoint_id: str, check: str, error: Exception) -> str:
    """The refusal of a check that raised instead of answering (its input is of a shape it did not
    expect): named, so the message reaches every rank (``errors.refuse_on_any_rank``) as one line."""
    return (f"checkpoint {checkpoint_id} cannot be checked: {check} failed on it ({root_cause(error)}), so it is "
            f"refused. A checkpoint gefen-titan or torchtitan wrote never does this (edited, or damaged): restore it "
            f"from a copy, or resume from another step; set GEFEN_TITAN_TRACEBACK=1 to see where it failed. Nothing "
            f"was loaded.")


class _CheckedReading(ItemReads):
    """Mixin over DCP's file system readers: checks ``.digests`` before anything is used (module docstring).

    ``metadata``/``digests``: already read (and checked) by the caller;
    ``check_unread``: also check the items no rank reads; ``load_checks``:
    a whole load's reader (``checked_metadata``). The targets handed to the
    load must not be live state (module docstring).
    """

    def __init__(self, path: Any, *args: Any, metadata: Metadata | None = None, digests: Any = _UNSET,
                 check_unread: bool = False, load_checks: LoadChecks | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._metadata = metadata
        self._digests = digests
        self._check_unread = check_unread
        self._load_checks = load_checks
        self._verdict: Any = _UNSET  # checked_metadata's: None once passed, else the refusal (str)
        self._set_up: Metadata | None = None  # set_up_storage_reader's: the raw items' chunk records
        self._layouts: dict[Any, Any] = {}  # _raw_layout's, per storage index
        self._chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}

    def _id(self) -> str:
        return str(self.path)

    def digests(self) -> dg.Digests | None:
        """The checkpoint's ``.digests`` (None: it has none), read once."""
        if self._digests is _UNSET:
            if self._metadata is None:
                self._metadata, self._digests = read_and_check_metadata(self.fs, self.path, self._id())
            else:
                p = self.fs.concat_path(self.path, dg.FILE)
                self._digests = None
                if self.fs.exists(p):
                    self._digests = dg.read(lambda: files.open_stream(self.fs, p), self._id())
                    self._digests.limit_rows(metadata_fields.items_per_file(self._metadata))
        return self._digests

    def reset(self, checkpoint_id: Any = None) -> None:
        # dcp.load(checkpoint_id=...) resets the reader it is handed: the same
        # checkpoint keeps what was read of it, another one starts afresh.
        path = self.path
        super().reset(checkpoint_id)
        if str(self.path) != str(path):
            self._metadata, self._digests, self._verdict = None, _UNSET, _UNSET

    def _read(self) -> Metadata:
        if self._metadata is None:
            self._metadata, record = read_and_check_metadata(self.fs, self.path, self._id())
            if self._digests is _UNSET:  # digests handed in by the caller stay theirs
                self._digests = record
        return self._metadata

    def checked_metadata(self) -> Metadata:
        """A whole load's ``.metadata``, read and checked once (``load_checks``), then the same object
        on every call; a refusal is raised the same on every call, as ``GefenCheckpointError``.

        Besides ``read_and_check_metadata``'s checks: ``.digests`` missing though the save
        wrote one, and (rank 0) stray bytes in the folder. Only rank 0 may
        refuse for those, so a caller outside ``dcp.load`` agrees on the verdict
        (``errors.refuse_on_any_rank``); inside it, DCP's gather does.
        """
        if self._load_checks is None:
            raise TypeError("checked_metadata is a whole load's: make the reader with load_checks")
        if self._verdict is _UNSET:
            self._verdict = self._check_whole()
            if self._verdict is None and self._digests is None:  # on every rank: each rank's log says what it loaded
                logger.warning(
                    f"checkpoint {self._id()} carries no {dg.FILE} (saved before gefen-titan recorded digests, by "
                    "torchtitan's own writer, or loaded with checkpoint.load_without_digests): loading it UNCHECKED; "
                    "`gefen-titan ckpt verify` checks its records' CRC32s")
        if self._verdict is not None:
            raise GefenCheckpointError(self._verdict)
        return self._metadata

    def _check_whole(self) -> str | None:
        """``checked_metadata``'s verdict: None, or why the checkpoint is refused."""
        try:
            metadata, record = self._read(), self.digests()
        except GefenCheckpointError as e:
            return str(e)
        except Exception as e:  # OSError, a foreign file
            return str(unreadable(self._id(), e, dg.step_problem))
        try:
            return self._check_folder(metadata, record)
        except Exception as e:  # a verdict on this rank for every rank, never a lone traceback
            return _failed_check(self._id(), "the checks of the whole checkpoint", e)

    def _check_folder(self, metadata: Metadata, record: dg.Digests | None) -> str | None:
        checks = self._load_checks
        if record is None and digest_format.expects_digests(metadata) and not checks.load_without_digests:
            return dg.corrupt_message(
                self._id(), dg.FILE, None, "missing, and its .metadata says the save wrote one (deleted "
                "or lost since); to load it unchecked anyway, set checkpoint.load_without_digests = true")
        if dist.is_initialized() and dist.get_rank() != 0:
            return None  # one rank sizes and lists the folder (the same files for all)
        # Rank 0 alone runs these; whatever one raises (a bug, a field of a type no check expected) must
        # become this rank's verdict, which every rank then agrees on, never a lone traceback.
        if checks.bounds is not None:  # before any buffer is allocated or any read issued
            try:
                bounds = checks.bounds(metadata)
            except GefenCheckpointError as e:  # a data file that is no regular file (checkpoint.format.files)
                return str(e)
            except OSError as e:
                return str(unreadable(self._id(), e, dg.step_problem))
            except Exception as e:
                return _failed_check(self._id(), "the metadata stage (metadata_checks.metadata_problems)", e)
            if bounds:
                return load_checks.refusal(self._id(), bounds)
        if record is not None and checks.stray_bytes is not None:
            try:
                stray = checks.stray_bytes(metadata)
            except GefenCheckpointError as e:
                return str(e)
            except OSError as e:
                stray = [(dg.METADATA_FILE, f"cannot list the folder ({e})")]
            except Exception as e:
                return _failed_check(self._id(), "the stray-bytes check (storage.stray_bytes)", e)
            if stray:
                return dg.corrupt_message(self._id(), stray[0][0], None, stray[0][1])
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP's fallback when .metadata cannot be read: a per-rank file it
            # would unpickle unrestricted. Never taken: the load fails instead.
            raise GefenCheckpointError(f"{self._id()}: per-rank metadata files are not read (only a checked "
                                       f"{dg.METADATA_FILE})")
        if self._load_checks is None:
            metadata = self._read()
        else:
            try:
                metadata = self.checked_metadata()
            except GefenCheckpointError:
                # DCP swallows read_metadata's errors (it logs them and tries per-rank
                # files, then raises its own). Its planner does not look at this
                # stand-in; set_up_storage_reader, next, raises the refusal, and DCP
                # raises that as it is on every rank (tests/unit/test_checkpoint_manager.py).
                return Metadata(state_dict_metadata={})
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Each rank's .digests is read here, in the planning round DCP makes
        # anyway: a rank that cannot read it raises, and DCP raises that on
        # every rank; whether it has one goes to the coordinator with the plan.
        plan = super().prepare_local_plan(plan)
        try:
            record = self.digests()
        except dg.CorruptCheckpointError:
            raise
        except Exception as e:  # an unreadable file
            raise dg.CorruptCheckpointError(dg.corrupt_message(
                self._id(), dg.FILE, None, f"cannot read it ({root_cause(e)})"), dg.FILE) from e
        return dataclasses.replace(plan, storage_data=_Found(record is not None))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank must take the same path in read_data (checked or not),
        # so they must all have found .digests, or none.
        found = {p.storage_data.digests for p in plans if isinstance(p.storage_data, _Found)}
        if len(found) > 1:
            raise dg.CorruptCheckpointError(
                f"the checkpoint cannot be loaded: ranks disagree whether {self._id()} has {dg.FILE} (does "
                "every rank see the same files?)")
        plans = super().prepare_global_plan(
            [dataclasses.replace(p, storage_data=None) if isinstance(p.storage_data, _Found) else p for p in plans])
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
        # Always our own read, with .digests or without: DCP's would unpickle byte entries unrestricted.
        record = self.digests()  # read (and agreed on) in the planning round: prepare_local_plan
        staged, error = self._read_and_check(plan, record, self._direct_targets(plan, planner))
        if isinstance(error, GefenCheckpointError):  # raised as it is: it pickles to every rank (DCP's gather)
            raise error
        if error:  # DCP's gather after the read step raises it on every rank
            raise dg.CorruptCheckpointError(error)
        # This rank's bytes are intact: only now does anything reach the planner's targets.
        uses: dict[Any, int] = {}
        for req in plan.items:
            uses[req.storage_index] = uses.get(req.storage_index, 0) + 1
        for req in plan.items:
            data = staged[req.storage_index]
            uses[req.storage_index] -= 1
            if isinstance(data, torch.Tensor):  # read straight into its staging target (_direct_targets)
                planner.commit_tensor(req, data)
                continue
            if not uses[req.storage_index]:
                del staged[req.storage_index]  # hold each item only until its last use
            try:  # an item that does not decode is refused naming its file and entry
                if req.type == LoadItemType.BYTE_IO:  # the entry stage of load_checks, then DCP's own use
                    load_bytes(planner, req, load_checks.read_byte_entry(
                        io.BytesIO(self._stream(req, data).read(-1)), req.storage_index.fqn, self._id()))
                    continue
                stored = self._tensor(req, data)
            except GefenCheckpointError:
                raise
            except Exception as e:
                raise dg.CorruptCheckpointError(dg.corrupt_message(
                    self._id(), self.storage_data[req.storage_index].relative_path, req.storage_index.fqn,
                    f"does not load ({root_cause(e)})")) from e
            tensor = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._load_checks is not None and self._verdict not in (None, _UNSET):  # read_metadata's refusal
            raise GefenCheckpointError(f"the checkpoint cannot be loaded: {self._verdict}")
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._set_up = metadata
        self._layouts.clear()
        self._chunks.clear()

class CheckedFileSystemReader(_CheckedReading, FileSystemReader):
    """DCP's ``FileSystemReader`` that checks ``.digests`` (module docstring)."""


class CheckedFsspecReader(_CheckedReading, FsspecReader):
    """DCP's ``FsspecReader`` (checkpoints at URLs) that checks ``.digests``."""
