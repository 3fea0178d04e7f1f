"""An offline, single-process view of one DCP checkpoint (one ``step-N`` folder).

The ``ckpt`` tools run as one process without a process group, on a machine
that may have no accelerator: every read goes through ``gefen_titan.checkpoint.io.storage``
(local folders and fsspec URLs, as torchtitan writes them) and DCP runs with
``no_dist=True``. Tensors are read whole (all chunks assembled), so a read
costs the memory of the entries it names, never of the whole checkpoint.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torchtitan.components.checkpoint import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, TRAIN_STATE

from gefen_titan.checkpoint.checks import load_checks, metadata_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError, root_cause
from gefen_titan.checkpoint.io import storage
from gefen_titan.optim.kinds import register_builtins

__all__ = ["CkptError", "Entry", "Checkpoint", "split_state_key"]

# Components torchtitan nests under their name; the model's entries sit at the top level.
COMPONENTS = (OPTIMIZER, DATALOADER, LR_SCHEDULER, TRAIN_STATE)
_WRITER_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP: __{rank}_{n}.distcp


class CkptError(Exception):
    """An expected problem (missing folder, foreign or corrupt checkpoint): the message says what to do.
    ``check``: the name in ``load_checks.CHECKS`` of the check that refused, where one did."""

    def __init__(self, message: str, check: str | None = None) -> None:
        super().__init__(message)
        self.check = check


@dataclass
class Entry:
    """One DCP entry: a tensor (with its saved chunks) or a pickled object."""

    key: str  # flat DCP key, e.g. "optimizer.gefen/codes/norm.weight"
    path: tuple  # where it sits in the saved state dict (planner data)
    shape: tuple[int, ...] | None = None  # None: a bytes entry
    dtype: torch.dtype | None = None
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # (offsets, sizes)
    files: list[str] = field(default_factory=list)  # files holding its items
    stored_bytes: int = 0  # bytes of its items on disk (framing included)

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape or ():
            n *= s
        return n

    @property
    def payload_bytes(self) -> int:
        return self.numel * self.dtype.itemsize if self.is_tensor else self.stored_bytes

    @property
    def component(self) -> str:
        """torchtitan's component (``model``, ``optimizer``, ``dataloader``, ...).

        From the saved nesting; a checkpoint saved with flat keys
        (``optimizer.x``) is read by its key's first part.
        """
        if len(self.path) > 1:
            return str(self.path[0])
        head = self.key.split(".", 1)[0]
        return head if head in COMPONENTS and "." in self.key else MODEL

    @property
    def name(self) -> str:
        """The key inside its component (``gefen/codes/x``, ``dp_rank_0``, a model fqn)."""
        if len(self.path) > 1:
            return ".".join(str(p) for p in self.path[1:])
        component = self.component
        return self.key if component == MODEL else self.key[len(component) + 1:]


def split_state_key(name: str) -> tuple[str, str] | None:
    """``state.{fqn}.{state}`` (torchtitan's flat optimizer keys) -> (fqn, state)."""
    if not name.startswith("state.") or name.count(".") < 2:
        return None
    fqn, _, state = name[len("state."):].rpartition(".")
    return fqn, state


class Checkpoint:
    """The entries, files and small values of one checkpoint folder."""

    def __init__(self, path: str) -> None:
        register_builtins()  # every tool opens a checkpoint here: the kinds' descriptions its checks read
        self.path = str(path)
        try:
            if not storage.is_remote(self.path) and storage.file_size(self.path, ".metadata") is None:
                raise CkptError(self._not_a_checkpoint())
            self.metadata: Metadata = storage.read_metadata(self.path)
        except GefenCheckpointError as e:  # its own message says what and why (ForbiddenObjectError, ...)
            raise CkptError(str(e), e.check) from e
        except Exception as e:  # OSError, CheckpointException, unpickling errors
            raise CkptError(f"cannot read {self.path}/.metadata ({root_cause(e)}): restore it from a copy, or "
                            "use another step's folder") from e
        # The load's metadata stage (metadata_checks): what a read of these files would allocate is bounded by
        # them. ``load`` refuses while any problem stands; inspect flags them, verify lists them.
        try:
            self.problems = storage.metadata_problems(self.path, self.metadata)
        except GefenCheckpointError as e:  # a data file that is no regular file (checkpoint.format.files)
            raise CkptError(str(e), e.check) from e
        self.allocation = metadata_checks.allocation(self.metadata)
        mapping = self.metadata.planner_data or {}
        self.entries: dict[str, Entry] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            path = tuple(mapping.get(key, (key,)))
            if isinstance(md, BytesStorageMetadata):
                self.entries[key] = Entry(key, path)
            else:
                chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
                self.entries[key] = Entry(key, path, tuple(md.size), md.properties.dtype, chunks)
        for index, info in self.metadata.storage_data.items():
            entry = self.entries.get(index.fqn)
            if entry is None or type(getattr(info, "length", None)) is not int or not isinstance(
                    getattr(info, "relative_path", None), str):  # a malformed item: in self.problems
                continue
            entry.stored_bytes += int(info.length)
            if info.relative_path not in entry.files:
                entry.files.append(info.relative_path)

    def _not_a_checkpoint(self) -> str:
        try:
            names = storage.list_files(self.path)
        except OSError:
            return (f"{self.path} does not exist or is not a folder: give a checkpoint folder such as "
                    ".../checkpoint/step-10")
        steps = sorted((n for n in names if re.fullmatch(r"step-\d+", n)), key=lambda n: int(n[5:]))
        if steps:
            return (f"{self.path} holds checkpoints, not one: give one of its step folders "
                    f"({', '.join(steps[-3:])})")
        return f"{self.path} has no .metadata: it is not a DCP checkpoint folder (or its save did not finish)"

    # ---------------------------------------------------------------- views
    def component(self, name: str) -> dict[str, Entry]:
        """Entries of one component, keyed by their name inside it."""
        return {e.name: e for e in self.entries.values() if e.component == name}

    @property
    def optimizer(self) -> dict[str, Entry]:
        return self.component(OPTIMIZER)

    def optimizer_key(self, name: str) -> str:
        """The flat DCP key of an optimizer entry (``optimizer.`` + name in torchtitan)."""
        for e in self.entries.values():
            if e.component == OPTIMIZER and e.name == name:
                return e.key
        return f"{OPTIMIZER}.{name}"

    def writer_ranks(self) -> list[int]:
        """Ranks that wrote data files (DCP names them ``__{rank}_{n}.distcp``)."""
        ranks = set()
        for info in self.metadata.storage_data.values():
            m = _WRITER_FILE.match(str(getattr(info, "relative_path", "")))
            if m:
                ranks.add(int(m.group(1)))
        return sorted(ranks)

    def data_files(self) -> list[str]:
        return sorted({p for info in self.metadata.storage_data.values()
                       if isinstance(p := getattr(info, "relative_path", None), str)})

    # ---------------------------------------------------------------- reads
    def load(self, keys: list[str]) -> dict[str, Any]:
        """Full values of the named entries (flat keys), in one DCP read."""
        if self.problems and keys:
            raise CkptError(load_checks.refusal(self.path, self.problems))
        sd: dict[str, Any] = {}
        for key in keys:
            e = self.entries[key]
            sd[key] = torch.empty(e.shape, dtype=e.dtype) if e.is_tensor else None
        if not sd:
            return {}
        try:
            with warnings.catch_warnings():
                # DCP warns that it runs in a single process: that is the point here.
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.load(sd, storage_reader=storage.storage_reader(self.path, metadata=self.metadata), no_dist=True)
        except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps the cause
            raise CkptError(str(storage.refusal(self.path, e))) from e
        return sd

    def load_names(self, component: str, names: list[str]) -> dict[str, Any]:
        """``load`` by names inside a component."""
        entries = self.component(component)
        values = self.load([entries[n].key for n in names])
        return {n: values[entries[n].key] for n in names}
