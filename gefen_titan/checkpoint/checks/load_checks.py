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
* ``metadata`` (``checkpoint.checks.metadata_checks``): ``.metadata`` against the folder's
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

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from gefen_titan.checkpoint.checks import entry_values, record_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError, fall_back
from gefen_titan.checkpoint.format import digests, schema, unpickling

__all__ = ["Check", "CHECKS", "Problem", "StepMismatchError", "refusal", "read_byte_entry", "stored_tensor_problem",
           "folder_step", "read_records", "record_problems", "is_loader_state"]


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
