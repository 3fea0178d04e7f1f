"""The values of the byte entries torchtitan's components save, checked before any component sees them.

Why here: a checkpoint folder can be written by anyone who can write to it
(``docs/checkpoints.md``, "Threat model"), ``.digests`` included when it is
unsigned. Unpickling with the allowlists (``checkpoint.format.unpickling``) keeps
code out, but a plain value of the wrong type or size still goes straight
into torchtitan's components: a tensor where ``lr_scheduler.last_epoch``'s
int was makes the LR lambda raise ``Boolean value of Tensor with more than
one value is ambiguous`` mid-resume; a ``train_state.step`` of 2^63 loads and
training goes on from there; a data loader position of 2^80 skips past its
data and trains on another epoch's. So the load's entry stage
(``load_checks.read_byte_entry``, which the resume and every tool that reads
byte entries run) calls ``check`` on every byte entry it reads, and a value
it refuses is an ``EntryValueError`` naming the entry (and the field) before
anything was loaded.

What it checks, of what torchtitan 0.3.0 saves (``tests/unit/test_entry_values.py``
saves the real components and reads them back through here):

* ``train_state.step`` and ``ntokens_seen`` (torchtitan's ``Trainer``),
  ``lr_scheduler.last_epoch`` (``LRSchedulersContainer``: only that),
  any other int of ``train_state``: a Python int in ``[0, COUNT_BOUND]``;
* ``dataloader.world_size``: an int in ``[1, WORLD_BOUND]``;
* a data loader's pickled state (``dataloader.dp_rank_N``): every int in it
  fits 64 bits (torchdata keeps int64 seeds there), and its positions and
  counters (``LOADER_COUNTERS``, wherever they sit in it) in
  ``[0, COUNT_BOUND]``. Checks against the dataset's size need the dataset:
  the loader's ``load_state_dict`` runs them (``data.elastic_dataset``).

Other entries are not torchtitan's to interpret here and pass unchanged.
"""

from __future__ import annotations

from typing import Any

from gefen_titan.checkpoint.errors import GefenCheckpointError, fall_back
from gefen_titan.checkpoint.format import digests

__all__ = ["COUNT_BOUND", "EntryValueError", "LOADER_COUNTERS", "WORLD_BOUND", "check", "check_loader_state"]

COUNT_BOUND = 1 << 53
"""The largest step, token count or loader position a checkpoint may hold: 2^53, the largest range in
which every integer is exact in float64 (metrics, LR schedules and logs turn these counters into floats;
beyond it two steps print and schedule alike). 2^53 steps is ~285 million years at one step a second, and
2^53 tokens ~9 quadrillion: no run reaches either."""

WORLD_BOUND = 1 << 20
"""The most data-parallel ranks a saved loader may claim (a million): a resume loops over the source ranks,
so a larger number would only hang it."""

_INT64 = (-(1 << 63), 1 << 64)  # [low, high): what int64 seeds and uint64 counters hold

LOADER_COUNTERS = frozenset({
    "sample_idx", "epoch",  # torchtitan's HuggingFaceTextDataset (and ours): documents read this epoch, the epoch
    "_num_yielded", "_sampler_iter_yielded", "_snapshot_step", "_steps_since_snapshot",  # torchdata's loader
    "elastic_batch_size",  # ours (data.loader_state.BATCH_SIZE_KEY)
})
"""Keys of a data loader's state whose int values are counts or positions, wherever they appear in it."""

_TRAIN_STATE = "train_state."
_COUNTERS = frozenset({"train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch"})
_WORLD = "dataloader.world_size"


class EntryValueError(GefenCheckpointError):
    """A byte entry holds a value of a type or size no save writes: refused before anything was loaded."""

    check = "entry values"


def _refuse(source: str, where: str, what: str) -> EntryValueError:
    return EntryValueError(
        f"checkpoint {source}: {where} {what}. No save of gefen-titan or torchtitan writes this (edited, or "
        f"damaged): restore the checkpoint from a copy or {fall_back(source, digests.step_problem)}. "
        "Nothing was loaded.")


def _shown(value: Any) -> str:
    if type(value) is int:
        return f"{value:,}" if abs(value) < 1 << 64 else f"an int of {value.bit_length()} bits"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _count_problem(value: Any, low: int = 0, high: int = COUNT_BOUND) -> str | None:
    if type(value) is not int:  # bool is no count; the allowlists build no other int subclass
        return f"is {_shown(value)}, not an int"
    if not low <= value <= high:
        return f"is {_shown(value)}, outside [{low:,}, {high:,}]"
    return None


def check(key: str, value: Any, source: str = "") -> None:
    """Raise ``EntryValueError`` if byte entry ``key``'s ``value`` is not one torchtitan's components save."""
    if key in _COUNTERS or (key.startswith(_TRAIN_STATE) and type(value) is int):
        why = _count_problem(value)
    elif key == _WORLD:
        why = _count_problem(value, 1, WORLD_BOUND)
    else:
        return
    if why:
        raise _refuse(source, f"entry {key}", why)


def check_loader_state(state: Any, key: str, source: str = "") -> None:
    """Raise ``EntryValueError`` if a data loader's unpickled state (entry ``key``) holds an int outside
    64 bits, or a count or position (``LOADER_COUNTERS``) outside ``[0, COUNT_BOUND]``; the field is named
    by its path in the state. Iterative: a deep nesting costs no recursion. A list of ints (the token
    buffers, thousands long) is checked by its extremes: 4 workers' buffers at seq_len 8192 (98,304 ints)
    in ~4 ms instead of ~50 ms element by element."""
    todo: list[tuple[str, Any]] = [("", state)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, dict):
            todo += [(f"{path}.{k}" if path else str(k), x) for k, x in v.items()]
        elif isinstance(v, (list, tuple, set, frozenset)):
            if v and set(map(type, v)) == {int} and _INT64[0] <= min(v) and max(v) < _INT64[1]:
                continue  # a token buffer: its extremes suffice (no count is a bare list element)
            todo += [(f"{path}[{i}]", x) for i, x in enumerate(v)]
        else:
            name = path.rsplit(".", 1)[-1]
            why = None
            if name in LOADER_COUNTERS and v is not None:
                why = _count_problem(v)
            elif type(v) is int and not _INT64[0] <= v < _INT64[1]:
                why = f"is {_shown(v)}, which no loader state holds (every int in one fits 64 bits)"
            if why:
                raise _refuse(source, f"entry {key}, field {path or '(the state)'},", why)
