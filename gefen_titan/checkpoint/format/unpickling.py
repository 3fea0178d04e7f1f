"""Reading the pickles inside a checkpoint without running code from them.

A checkpoint folder can come from anyone who could write to it (a shared
file system, a bucket, a downloaded run), and unpickling runs whatever
callables a pickle names: DCP ``pickle.load``s ``.metadata``, its default
planner ``torch.load(weights_only=False)``s every byte entry, and a data
loader's state is a pickle inside a byte entry. Every such read in
gefen-titan (the training load, ``storage.load_all``, the ``ckpt`` tools,
the validation) goes through this module, which names the globals a pickle
may reach and refuses the rest before anything is built from them:

* ``.metadata``: DCP's metadata dataclasses and what they hold
  (``torch.Size``, dtypes, layouts, the memory-format enum, paths);
* byte entries: ``torch.load(weights_only=True)``, torch's own allowlist of
  plain data and tensors, plus ``ENTRY_GLOBALS`` (empty: torchtitan's train
  state, its LR schedulers, Gefen's records and our loaders store plain
  ints, strings and bytes; a test saves every shipped recipe and reads it
  back through here);
* a data loader's pickled state: plain containers and scalars only.

An allowlisted callable must be harmless whatever its arguments (a class
whose constructor only stores them, a lookup): ``find_class`` is the only
door a pickle has to code, so what it hands out is all a hostile pickle can
call. A refusal is ``ForbiddenObjectError``, naming the file or entry and
the global. Allowed types alone can still crash or exhaust a reader (deep
nesting, shared objects copied per use, a deflated archive member): every
read here is also within budgets (``pickle_budget``; ``.metadata`` inside
the C unpickler, ``unpickle_metadata``; archives, ``check_archive``).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pathlib
import pickle
import re
import threading
import zipfile
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import filesystem, metadata

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import pickle_budget

__all__ = ["ForbiddenObjectError", "METADATA_GLOBALS", "ENTRY_GLOBALS", "LOADER_GLOBALS", "unpickle_metadata",
           "load_entry", "check_archive", "loads_loader_state"]

# (module, name) a .metadata pickle may name; torch dtypes (``torch.float32``, ...) too.
METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a local save
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
})

# Types a byte entry may hold beyond torch's weights_only allowlist (plain data, tensors, dtypes).
ENTRY_GLOBALS: tuple[Any, ...] = ()

# A data loader's state (torchdata's StatefulDataLoader and our datasets' state dicts): plain data only.
LOADER_GLOBALS = frozenset({("collections", "OrderedDict")})

_UNSUPPORTED = re.compile(r"GLOBAL ([\w.]+)")  # torch's weights_only refusal names the global so


class ForbiddenObjectError(GefenCheckpointError):
    """A pickle in a checkpoint names a global outside the allowlist: it was not unpickled."""

    check = "byte entries"

    def __init__(self, where: str, name: str, source: str = "") -> None:
        self.where, self.name, self.source = where, name, source
        in_ckpt = f"checkpoint {source}: " if source else ""
        super().__init__(
            f"{in_ckpt}{where} names {name}, which a checkpoint may not hold (reading it could run code): "
            "refused before anything was built from it. A checkpoint gefen-titan or torchtitan wrote never "
            "does; if you wrote this one yourself, store plain data there. Nothing was loaded.")

    def __reduce__(self) -> tuple:
        # DCP gathers a rank's exception to every rank by pickling it; the default
        # reduce would call __init__ with the message alone and fail on the other
        # ranks (TypeError), losing the entry and the global it names.
        return type(self), (self.where, self.name, self.source), self.__dict__


class _Restricted(pickle.Unpickler):
    def __init__(self, file: BinaryIO, allowed: frozenset, where: str, source: str, dtypes: bool) -> None:
        super().__init__(file)
        self._allowed, self._where, self._source, self._dtypes = allowed, where, source, dtypes

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return super().find_class(module, name)
        if self._dtypes and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ForbiddenObjectError(self._where, f"{module}.{name}", self._source)

    def persistent_load(self, pid: Any) -> Any:
        raise ForbiddenObjectError(self._where, f"a persistent id ({type(pid).__name__})", self._source)


# ------------------------------------------------------------------ .metadata within budgets, at C speed
# pickle_budget's opcode walk costs ~10x the C unpickling it guards (+14% of a 150M load, measured), so
# .metadata, read on every rank of every load, is guarded inside the C unpickler instead, where the harm
# is done: (1) C recursion: only hashing recurses without a limit (a dict key, a set member, an enum or
# layout lookup), and only through nested tuples and frozensets; their nesting is at most the count of
# the bytes that can be their opcodes, so below HASH_SAFE_NESTING (hashing overflows an 8 MiB stack
# between 100,000 and 200,000 levels; measured) the C unpickler cannot recurse past it, and above it the
# walk runs first; (2) copies per use: the C unpickler builds each object once (no more objects than
# opcodes), and an object used again costs only where it is copied: a BUILD's state into an instance,
# a constructor's arguments (torch.Size, paths, OrderedDict). Every allowed class is handed out as a
# subclass whose __setstate__ charges its state's length, every allowed constructor as a function that
# charges its arguments' (and refuses arguments of types DCP never passes, such as a tuple to hash);
# the charges are bounded by COPY_BUDGET. Then each object takes its DCP class back (_restore) at the
# places DCP's metadata holds them; metadata_fields refuses any object left elsewhere.
HASH_SAFE_NESTING = 10_000
COPY_BUDGET = 1 << 20  # references or characters copied, plus one per byte of the pickle
_charges = threading.local()


def _charge(n: int) -> None:
    budget = _charges.left
    budget[0] -= n
    if budget[0] < 0:
        raise pickle_budget.OverBudgetError(".metadata", "objects copied more than the budget allows (a shared "
                                            "object used again and again)", _charges.source)


def _guarded_class(base: type) -> type:
    def __setstate__(self: Any, state: Any) -> None:
        if type(state) is dict:
            _charge(len(state) + 1)
            self.__dict__.update(state)  # what the C unpickler's BUILD does without __setstate__
        elif type(state) is tuple and base.__dict__.get("__setstate__") is not None:
            _charge(len(state) + 1)
            base.__setstate__(self, state)  # TensorProperties keeps its state as a tuple
        else:
            raise pickle.UnpicklingError(f"{base.__name__} built from a {type(state).__name__}")

    return type(base.__name__, (base,), {"__slots__": (), "__setstate__": __setstate__, "__module__": __name__})


def _charged(call: Any, types: tuple[type, ...], size: Any) -> Any:
    def make(*args: Any) -> Any:
        if not all(type(a) in types for a in args):
            raise pickle.UnpicklingError(f"{getattr(call, '__name__', call)} of {[type(a).__name__ for a in args]}")
        _charge(1 + sum(size(a) for a in args))
        return call(*args)

    return make


def _guards() -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for module, name in METADATA_GLOBALS:
        obj = getattr({"torch.distributed.checkpoint.metadata": metadata, "torch.distributed.checkpoint.filesystem":
                       filesystem}.get(module), name, None)
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            out[(module, name)] = _guarded_class(obj)
    out[("torch", "Size")] = _charged(torch.Size, (tuple, list), len)
    out[("collections", "OrderedDict")] = _charged(collections.OrderedDict, (list, tuple), len)
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        out[("pathlib", name)] = _charged(getattr(pathlib, name), (str,), len)
    # Private names of torch's, as METADATA_GLOBALS names them (DCP pickles them; pinned by test_contract_dcp).
    out[("torch.serialization", "_get_layout")] = _charged(
        torch.serialization._get_layout, (str,), len)  # noqa: SLF001
    out[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = _charged(
        metadata._MEM_FORMAT_ENCODING, (int, str), lambda v: 1)  # noqa: SLF001
    return out


_GUARDS: dict[tuple[str, str], Any] = {}


class _GuardedMetadata(_Restricted):
    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)  # the allowlist first: ForbiddenObjectError
        return _GUARDS.get((module, name), found)


def _restore(md: Any) -> None:
    """Each guarded object back to its DCP class, at the places DCP's metadata holds them (one pass over
    the entries and items; no recursion). An object anywhere else stays guarded: metadata_fields refuses it."""
    bases = {guard: guard.__bases__[0] for guard in _GUARDS.values() if isinstance(guard, type)}

    def back(obj: Any) -> None:
        base = bases.get(type(obj))
        if base is not None:
            object.__setattr__(obj, "__class__", base)  # frozen dataclasses too

    back(md)
    fields = getattr(md, "__dict__", {})  # any object a pickle built: read without attribute lookups
    entries, items = fields.get("state_dict_metadata"), fields.get("storage_data")
    for entry in entries.values() if type(entries) is dict else ():
        back(entry)
        props, chunks = getattr(entry, "__dict__", {}).get("properties"), getattr(entry, "__dict__", {}).get("chunks")
        back(props)
        for chunk in chunks if type(chunks) is list else ():
            back(chunk)
    for index, info in items.items() if type(items) is dict else ():
        back(index)
        back(info)
    back(fields.get("storage_meta"))


def unpickle_metadata(raw: bytes, source: str = "") -> Any:
    """``.metadata``'s bytes unpickled with ``METADATA_GLOBALS`` only (``ForbiddenObjectError`` otherwise),
    within budgets (``pickle_budget.OverBudgetError``): the walk first where tuples may nest past
    ``HASH_SAFE_NESTING``, copies charged inside the C unpickler (comment above)."""
    nesting = sum(raw.count(op) for op in (b"\x85", b"\x86", b"\x87", b"\x91")) + min(raw.count(b"t"), raw.count(b"("))
    if nesting > HASH_SAFE_NESTING:
        pickle_budget.check(raw, ".metadata", source, pickle_budget.METADATA)
    if not _GUARDS:
        _GUARDS.update(_guards())
    _charges.left, _charges.source = [COPY_BUDGET + len(raw)], source
    try:
        md = _GuardedMetadata(io.BytesIO(raw), METADATA_GLOBALS, ".metadata", source, dtypes=True).load()
    finally:
        _charges.left = None
    _restore(md)
    return md


def load_entry(stream: BinaryIO | bytes, entry: str, source: str = "") -> Any:
    """A byte entry (DCP's ``torch.save`` of a non-tensor value), read with ``weights_only=True``.

    ``ForbiddenObjectError`` names the entry and the global when the pickle
    reaches outside the allowlist; ``pickle_budget.OverBudgetError`` when its
    zip members are compressed (a deflate bomb: ``torch.save`` stores them)
    or its pickle would build beyond ``pickle_budget.ENTRY``; other
    unpickling errors propagate (damaged bytes).
    """
    if isinstance(stream, (bytes, bytearray, memoryview)):
        stream = io.BytesIO(stream)
    check_archive(stream, f"entry {entry}", source)
    try:
        with torch.serialization.safe_globals(list(ENTRY_GLOBALS)):
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not str(e).startswith("Weights only load failed"):
            raise
        m = _UNSUPPORTED.search(str(e))
        name = m.group(1) if m else "an object outside torch's weights_only allowlist"
        raise ForbiddenObjectError(f"entry {entry}", name, source) from None


def check_archive(stream: BinaryIO, where: str, source: str = "") -> None:
    """Bound what ``torch.load`` of a ``torch.save`` archive can inflate, before it reads it: every
    member stored uncompressed (``torch.save`` compresses none, so no member holds more than the
    item's own bytes) and its pickle (``*/data.pkl``) within ``pickle_budget.ENTRY``. Bytes that are
    no zip archive are left to ``torch.load`` to refuse. The stream is left at its start."""
    start = stream.tell()
    try:
        try:
            archive = zipfile.ZipFile(stream)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError):
            return  # no archive (a legacy torch.save, or damage): torch.load's to read or refuse
        members = archive.infolist()
        for m in members:
            if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size:
                raise pickle_budget.OverBudgetError(
                    where, f"member {m.filename[-60:]} is compressed ({m.compress_size:,} bytes inflating to "
                           f"{m.file_size:,}), which torch.save never does", source)
        for m in members:
            if m.filename.endswith("data.pkl"):
                try:
                    raw = archive.read(m)
                except (zipfile.BadZipFile, ValueError, OSError, EOFError):
                    return  # damaged: torch.load's to refuse
                pickle_budget.check(raw, where, source, pickle_budget.ENTRY)
    finally:
        stream.seek(start)


def loads_loader_state(raw: bytes, entry: str, source: str = "") -> Any:
    """A data loader's pickled state (torchtitan pickles one per data-parallel rank), plain data only,
    within ``pickle_budget.LOADER``."""
    pickle_budget.check(raw, f"entry {entry}", source, pickle_budget.LOADER)
    return _Restricted(io.BytesIO(raw), LOADER_GLOBALS, f"entry {entry}", source, dtypes=False).load()
