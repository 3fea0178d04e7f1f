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
the global.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from typing import Any, BinaryIO

import torch

from gefen_titan.checkpoint import pickle_budget
from gefen_titan.checkpoint.errors import GefenCheckpointError

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


def unpickle_metadata(raw: bytes, source: str = "") -> Any:
    """``.metadata``'s bytes unpickled with ``METADATA_GLOBALS`` only (``ForbiddenObjectError`` otherwise)."""
    return _Restricted(io.BytesIO(raw), METADATA_GLOBALS, ".metadata", source, dtypes=True).load()


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
