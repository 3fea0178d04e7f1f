"""One description per optimizer kind of what its checkpoint state is, read by the load and the offline tools.

An optimizer kind with records of its own (Gefen, GefenMuon, a kind a test
adds) describes its state once, in a ``KindDescription`` its own files
build: the key kinds it writes (its rows of the format, ``schema.KeyRow``), how its records are
parsed and checked without a live model (the records stage of
``load_checks``: the load runs it on its one small read, ``ckpt verify`` on
its own), which of its tensors ``verify`` requires to be non-negative, its
rows and lines in ``ckpt inspect`` and in ``verify``'s summary, why
``ckpt convert`` cannot convert it (if it cannot), and the entries one of its
optimizers writes, from its parameters alone (``PlannedEntries``: the scale
plan, ``benchmarks/scale.py``, plans a checkpoint it never writes). The registry entry of the
kind (``optim.registry.OptimizerSpec.checkpoint``) carries it and
``optim.registry.register`` registers it here, so the records stage (this
layer, below the optimizers) and the tools (above them) iterate over the
same descriptions and name no kind. A key in Gefen's namespace of a kind no
description claims is a problem of the records stage (``record tensors``):
the load and ``verify`` refuse it, ``inspect`` warns.

This module is below every kind: it defines the description, the parsed
records a kind's reader returns, the stage's check names and the helpers
the kinds' readers share; it names no kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gefen_titan.checkpoint.format import schema, schema_records

__all__ = ["RECORDS", "RECORD_TENSORS", "CODEBOOKS", "Problem", "RecordsInput", "KindRecords", "KindDescription",
           "InspectView", "PlannedParam", "PlannedEntries", "register", "unregister", "descriptions",
           "described_key_kinds", "check_tensor", "check_codebooks", "nonnegative_problem"]

# The checks of the records stage, by their name in load_checks.CHECKS.
RECORDS = "records"  # the header and every record parse; counters, hyperparameters, one record per parameter
RECORD_TENSORS = "record tensors"  # the tensors a record implies, present with their shape and dtype; no stray one
CODEBOOKS = "codebooks"  # valid, one for the job (v2, v3), present wherever there is state

Problem = tuple[str, str, str]  # (check, entry name inside "optimizer.", what)


@dataclass(frozen=True)
class RecordsInput:
    """What a kind's reader reads: the optimizer component's entries (names without ``optimizer.`` ->
    DCP metadata), their parsed keys, the small entries' values and the header."""

    entries: dict[str, Any]
    parsed: dict[str, schema.Key]
    values: dict[str, Any]
    header: schema_records.Header

    def names_of(self, key_kind: str) -> list[str]:
        """The entries of one key kind (``schema.Key.kind``), sorted."""
        return sorted(n for n, k in self.parsed.items() if k.kind == key_kind)


@dataclass
class KindRecords:
    """One kind's records as its reader parsed them."""

    kind: str  # the registry name
    optimizers: list[Any]  # its optimizers' parsed records: ``opt``, ``params`` (each ``fqn``, ``shape``), ...
    codebooks: dict[str, torch.Tensor] = field(default_factory=dict)  # entry name -> valid codebook
    tensor_kinds: frozenset[str] = frozenset()  # the key kinds of its parameters' state tensors
    owner: dict[str, str] = field(default_factory=dict)  # fqn -> the entry of the record that holds it

    @property
    def params(self) -> list[Any]:
        return [p for o in self.optimizers for p in o.params]


class InspectView(Protocol):
    """What ``ckpt inspect`` lends a kind's rows (``KindDescription.rows``): the generic parts."""

    def load(self, names: list[str]) -> dict[str, Any]:
        """Optimizer entries (names inside it), read."""

    def tensors(self, names: list[str]) -> dict[str, Any]:
        """Of those entries present: ``bytes`` (payload), ``stored_bytes`` and ``cuts`` (the first's chunks)."""

    def optimizer_row(self, kind: str, o: Any, params: list[dict[str, Any]], codebooks: list[str],
                      shared: list[str], extra: dict[str, Any]) -> dict[str, Any]:
        """One optimizer's row from its parameters' rows, its codebooks' and other entries' names."""


@dataclass(frozen=True)
class PlannedParam:
    """One parameter of an optimizer as a plan sees it: no live optimizer, the state it would have."""

    fqn: str
    shape: tuple[int, ...]  # global
    period: int
    step: int
    group: dict[str, Any]  # its param group's keys
    options: dict[str, Any] = field(default_factory=dict)
    """Its kind's options that shape the state (Gefen's ``second_moment``, resolved: "block" or "factored");
    empty: the kind's defaults."""


@dataclass(frozen=True)
class PlannedEntries:
    """What one optimizer of the kind writes in a checkpoint of format ``schema.VERSION``, from its parameters
    alone, in the order its state adapter writes them (after the header, which every kind shares)."""

    param_tensors: Callable[[PlannedParam], dict[str, tuple[torch.dtype, tuple[int, ...]]]]
    """A stateful parameter's tensors: key -> (dtype, global shape), each sharded like the parameter."""
    optimizer_entries: Callable[[str, list[PlannedParam], int, bool], dict[str, Any]]
    """(optimizer id, its parameters, global step, deterministic) -> its own entries, written after its
    parameters' on every rank: key -> a record's value (as saved) or a plain tensor's (dtype, shape)."""


@dataclass(frozen=True)
class KindDescription:
    """Everything the records stage and the offline tools know of one kind's checkpoint state."""

    name: str
    """The registry name (``OptimizerSpec.name``)."""
    key_rows: tuple[schema.KeyRow, ...]
    """Every key kind it writes, as rows of the format (records, codebooks, its parameters' tensors, v1's
    too): ``register`` registers them with ``schema``, which names no kind."""
    read: Callable[[RecordsInput, list[Problem]], KindRecords]
    """Its records parsed and checked (counters, hyperparameters, the tensors they imply, codebooks);
    problems appended. Called only where one of ``key_kinds`` is present."""
    versions: frozenset[int]
    """The formats (``schema.VERSIONS``) that hold state of it: its keys in another are refused."""
    nonnegative: frozenset[str] = frozenset()
    """Its tensors' key kinds whose values are finite and >= 0 in any state it makes: the load refuses any
    other value (its adapter's stage, ``nonnegative_problem``), and ``verify`` checks these kinds' entries
    with the same function."""
    report_key: str = ""
    """``verify``'s report field of its summary (``summary``)."""
    summary: Callable[[KindRecords, int], dict[str, Any]] | None = None
    """(its records, the format version) -> ``verify``'s summary of them."""
    summary_line: Callable[[dict[str, Any]], str] | None = None
    """That summary as ``verify``'s text line."""
    rows: Callable[[InspectView, KindRecords, int], list[dict[str, Any]]] | None = None
    """(view, its records, version) -> ``inspect``'s rows, one per optimizer (``kind`` = ``name``)."""
    render: Callable[[dict[str, Any]], list[str]] | None = None
    """One of its rows as ``inspect``'s text (without the totals line)."""
    convert_refusal: str | None = None
    """Why ``ckpt convert`` refuses a checkpoint holding its state and what to do instead (None: it converts)."""
    planned_entries: PlannedEntries | None = None
    """The entries one of its optimizers writes, for a plan (None: no plan of its checkpoint)."""
    key_docs: dict[int, tuple[tuple[str, str, str], ...]] = field(default_factory=dict)
    """``docs/checkpoint_format.md``'s rows of its keys: format version -> (key kind, value, written by),
    in the doc's order (``schema_doc``)."""

    @property
    def key_kinds(self) -> frozenset[str]:
        """Every key kind it writes (its rows')."""
        return frozenset(r.kind for r in self.key_rows)


_DESCRIPTIONS: dict[str, KindDescription] = {}


def register(desc: KindDescription) -> KindDescription:
    """Called by ``optim.registry.register`` for an entry with a description."""
    taken = described_key_kinds()
    if desc.name in _DESCRIPTIONS or desc.key_kinds & taken:
        raise ValueError(f"kind {desc.name!r} or one of its key kinds {sorted(desc.key_kinds & taken)} is described "
                         "already")
    schema.register_rows(desc.key_rows)  # all or none: ValueError before anything is registered
    _DESCRIPTIONS[desc.name] = desc
    return desc


def unregister(name: str) -> None:
    """Drop a description and its key rows (a test's kind, restored after)."""
    desc = _DESCRIPTIONS.pop(name, None)
    if desc is not None:
        schema.unregister_rows(desc.key_kinds)


def descriptions() -> tuple[KindDescription, ...]:
    """Every registered description, in registration order (the same on every rank)."""
    return tuple(_DESCRIPTIONS.values())


def described_key_kinds() -> frozenset[str]:
    return frozenset(k for d in _DESCRIPTIONS.values() for k in d.key_kinds)


# ------------------------------------------------------------------ helpers of the kinds' readers
def nonnegative_problem(t: torch.Tensor) -> str | None:
    """Why a magnitude or second moment (a ``nonnegative`` kind's values) is no state its optimizer's
    arithmetic made: non-finite or negative values (None: none). The one check of them: the load's
    (``optim.checkpointing.sharded.check_finite_nonnegative``, v1's ``gefen_per_rank``) and ``verify``'s."""
    bad = ~torch.isfinite(t) | (t < 0)
    if not bool(bad.any()):
        return None
    return f"{int(bad.sum()):,} of its {t.numel():,} values non-finite or negative"


def check_tensor(entries: dict[str, Any], name: str, shape: tuple, dtype: torch.dtype, why: str) -> str | None:
    """Why the entry ``name`` is not a tensor of ``dtype`` and global ``shape`` (``why``: what implies it)."""
    md = entries.get(name)
    if md is None:
        return f"{name} missing ({why}): the checkpoint is truncated or was edited"
    if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(shape) or md.properties.dtype != dtype:
        got = f"{md.properties.dtype} {tuple(md.size)}" if isinstance(md, TensorStorageMetadata) else "a non-tensor"
        return f"{name} is {got}, expected {dtype} {tuple(shape)} ({why})"
    return None


def check_codebooks(names: list[str], values: dict[str, Any], what: str, out: dict[str, torch.Tensor],
                    problems: list[Problem]) -> None:
    """Each codebook valid, and all of them one (an agreed checkpoint has one codebook per kind for the job)."""
    for name in names:
        try:
            out[name] = schema_records.check_codebook(values[name], f"{what} {name}")
        except schema.FormatError as e:
            problems.append((CODEBOOKS, name, str(e)))
    valid = list(out.items())
    for name, cb in valid[1:]:
        if not torch.equal(valid[0][1], cb):
            problems.append((CODEBOOKS, name, f"the {what}s disagree ({valid[0][0]} != {name}); an agreed "
                                              f"checkpoint has one {what} for the job"))
