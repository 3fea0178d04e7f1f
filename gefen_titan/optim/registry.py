"""The optimizers a recipe can name, and what gefen-titan knows about each.

torchtitan 0.3.0 resolves ``optimizer_name`` through a hard-coded dict
(``OptimizersContainer._resolve_optimizer_factory``: Adam, AdamW, DistMuon).
``GefenOptimizersContainer`` looks names up here first and falls back to
torchtitan's dict for the rest (DistMuon, and whatever a later torchtitan
adds). An entry (``OptimizerSpec``) is everything the container, the recipe
checks and the checkpoint need to know about one optimizer, so a new Gefen
variant is one ``register`` call plus its state type and records. This module
is the mechanism only: the built-in entries are ``gefen_titan.optim.kinds``'
(one folder per kind), registered by its ``register_builtins()``, which the
container and every tool call before they look a name up:

* ``factory``: torchtitan's factory signature, ``(param_groups, **kwargs)``;
* ``owns``: whether a built optimizer is of this entry, by exact type. gefen-x's
  ``GefenMuon`` subclasses ``Gefen`` and keeps other state: a subclass is never
  taken for its base (the container refuses a Gefen subclass no entry owns);
* ``group_keys``: the ``optimizer_kwargs`` keys a param group of it honours
  (torch and gefen-x keep unknown group keys without a word, so the recipe
  checks refuse any other);
* ``option_keys``: optimizer-wide constructor options the container fills in
  for every group of this optimizer, from its ``options``;
* ``constructor``: every keyword of the gefen-x constructor it builds,
  classified (``gefenx.Constructor``: applied in its table, routed, refused),
  which ``optim.option_routes`` applies to every route; None (torch's): factory
  kwargs go to the factory as they are;
* ``options``: the ``[optimizer]`` table of its own options (``optimizer.gefen``,
  ``optimizer.muon``: an attribute of the container's Config), None for none;
* ``options_type``: that table's class (an ``optim.options_table.OptionsTable``
  dataclass whose ``kwargs(config)`` are the ``option_keys``); the container's Config
  has one field of it per registered table, generated (``optim.config_tables``);
* ``shorthand_keys``: the ``[optimizer]`` shorthand hyperparameters (lr,
  betas, eps, weight_decay) that are defaults of its groups (GefenMuon takes
  lr and weight_decay; Adam's betas and eps mean nothing to it);
* ``state``: how its state is checkpointed (a ``StateAdapter`` factory over the
  container's optimizers of this entry), None for torchtitan's flat
  per-parameter state dict;
* ``record_kind``: the key kind (``schema.parse_key``) of the optimizer
  records its state writes, so the load's kinds check can say which
  optimizer saved a parameter;
* ``agreed_blocking``: the first step's agreement pre-sets its block periods
  and codebook (``gefen_titan.optim.blocking``);
* ``codebook_family``: with ``agreed_blocking``, which of the job's codebooks
  it takes (an index; every family learns one from its own optimizers'
  gradients: Gefen 0, GefenMuon 1, a new kind the next free one);
* ``needs_agreed_blocking``: why it cannot run under ``optimizer.blocking =
  "per_rank"`` (None: it can); the recipe checks and the container refuse it;
* ``check_built``: refuses (ValueError) a built optimizer whose options
  gefen-titan cannot keep (e.g. Gefen's ``capturable``);
* ``after_agreed_step``: what the container does for it after each step under
  agreed blocking (Gefen: count the steps of its empty local shards, which
  keep no state, so the records agree on every rank);
* ``step_stats``: a built optimizer's step statistics on this rank (GefenMuon:
  its sharded step's ``MuonStepStats``), for the container's ``step_stats``;
* ``checkpoint``: the kind's description of its checkpoint state
  (``checkpoint.format.kinds.KindDescription``, built by the kind's own files:
  its key kinds, its records' checks, its rows in ``ckpt inspect``, its
  ``verify`` summary and non-negative tensors, why ``convert`` refuses it).
  ``register`` registers it with ``checkpoint.format.kinds``, where the load's
  records stage and the offline tools find it;
* ``validation``: its part of the reshard validation (``optim.kind_validation``:
  live facts, dense state, per-rank comparison); None: compared as entries only;
* ``cost``: what its state costs (``optim.state_cost.StateCost``: bytes per parameter
  shard and per optimizer, by rule and live), read by ``optim.state_size`` and the scale plan.

The container, the recipe checks and the load know an optimizer only
through these fields: a new kind adds an entry, its state type and its
records, and no container code.

A ``CompositeSpec`` (``register_composite``) is a name ``[optimizer] name``
takes that is no optimizer at run time: it expands into param groups of
registered optimizers, chosen by module once the model parts exist
(``GefenMuonHybrid``: ``gefen_titan.optim.hybrid``), so its checkpoints hold
only those optimizers' records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

from gefen_titan.checkpoint.format import kinds
from gefen_titan.checkpoint.format.kinds import KindDescription
from gefen_titan.optim.checkpointing import StateAdapter
from gefen_titan.optim.kind_validation import KindValidation
from gefen_titan.optim.options_table import OptionsTable
from gefen_titan.optim.state_cost import StateCost

if TYPE_CHECKING:  # annotations only
    import torch

    from gefen_titan.optim import gefenx as gx

__all__ = ["SHORTHAND_KEYS", "CompositeSpec", "OptimizerSpec", "StateOptions", "codebook_families",
           "codebook_family", "composite", "composite_names", "get", "names", "option_tables", "record_kinds",
           "register", "register_composite", "spec_of", "specs", "unregister"]

# The [optimizer] shorthand hyperparameters a group can take as defaults.
SHORTHAND_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class StateOptions:
    """What a state adapter needs from the optimizer config."""

    blocking: str  # "agreed" | "per_rank"


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    factory: Callable[..., Optimizer]
    owns: Callable[[Optimizer], bool]
    group_keys: tuple[str, ...]
    option_keys: tuple[str, ...] = ()
    options: str | None = None
    options_type: type[OptionsTable] | None = None
    state: Callable[[list[Optimizer], StateOptions], StateAdapter] | None = None
    record_kind: str | None = None
    agreed_blocking: bool = False
    codebook_family: int | None = None
    needs_agreed_blocking: str | None = None
    check_built: Callable[[Optimizer], None] | None = None
    after_agreed_step: Callable[[Optimizer], None] | None = None
    group_key_hint: Callable[[str], str] = lambda key: ""
    """A hint for a group key the optimizer does not read (where it goes instead)."""
    shorthand_keys: tuple[str, ...] = SHORTHAND_KEYS
    step_stats: Callable[[Optimizer], Any] | None = None
    checkpoint: KindDescription | None = None
    validation: KindValidation | None = None
    cost: StateCost | None = None
    constructor: gx.Constructor | None = None


@dataclass(frozen=True)
class CompositeSpec:
    """A name ``[optimizer] name`` takes that expands into param groups of
    registered optimizers (no optimizer of its own at run time)."""

    name: str
    param_groups: Callable[[Any], list[Any]]
    """The ``[optimizer]`` config -> its ``ParamGroupConfig`` groups, patterns
    not yet bound (the recipe checks read their optimizers and keys)."""
    bind: Callable[[list[Any], list[torch.nn.Module]], list[Any]]
    """Those groups and the model parts -> the groups the container builds."""
    check: Callable[[Any], None]
    """Refuses (ValueError) an ``[optimizer]`` config whose keys of this name
    have no effect or no valid value (the recipe checks call it)."""
    option_keys: tuple[str, ...]
    """The fields of its ``options`` table, which only this name reads."""
    refused_keys: dict[str, str]
    """Options of the optimizer it stands for that have no field here -> why."""
    kind_hint: Callable[[Any, str, str], str]
    """(``[optimizer]`` config, kind that saved a parameter, kind the config
    gives it) -> the setting that resumes it, for the kinds check ("" if none)."""
    options: str | None = None
    """The ``[optimizer]`` table of its options (``option_keys``; an attribute of the Config)."""
    options_type: type[OptionsTable] | None = None
    """That table's class (``optim.options_table.OptionsTable``)."""


_REGISTRY: dict[str, OptimizerSpec] = {}
_COMPOSITES: dict[str, CompositeSpec] = {}


def _check_table(spec: OptimizerSpec | CompositeSpec) -> None:
    if (spec.options is None) != (spec.options_type is None):
        raise ValueError(f"optimizer {spec.name!r}: options and options_type go together (the table and its class)")
    if spec.options is not None and option_tables().get(spec.options, spec.options_type) is not spec.options_type:
        raise ValueError(f"optimizer {spec.name!r}: table optimizer.{spec.options} is already registered with "
                         f"another class ({option_tables()[spec.options].__name__})")


def register(spec: OptimizerSpec) -> OptimizerSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"optimizer {spec.name!r} is already registered")
    _check_table(spec)
    if spec.checkpoint is not None:
        kinds.register(spec.checkpoint)
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Drop an entry and its checkpoint description (a test's kind, restored after)."""
    spec = _REGISTRY.pop(name, None)
    if spec is not None and spec.checkpoint is not None:
        kinds.unregister(spec.checkpoint.name)


def register_composite(spec: CompositeSpec) -> CompositeSpec:
    if spec.name in _REGISTRY or spec.name in _COMPOSITES:
        raise ValueError(f"optimizer {spec.name!r} is already registered")
    _check_table(spec)
    _COMPOSITES[spec.name] = spec
    return spec


def get(name: str) -> OptimizerSpec | None:
    return _REGISTRY.get(name)


def composite(name: str) -> CompositeSpec | None:
    return _COMPOSITES.get(name)


def names() -> tuple[str, ...]:
    """The optimizers a param group can name."""
    return tuple(_REGISTRY)


def composite_names() -> tuple[str, ...]:
    """The names only ``[optimizer] name`` takes (expanded into groups)."""
    return tuple(_COMPOSITES)


def option_tables() -> dict[str, type[OptionsTable]]:
    """Every registered ``[optimizer]`` table -> its class, entries' then composites', in registration order."""
    tables: dict[str, type[OptionsTable]] = {}
    for spec in (*_REGISTRY.values(), *_COMPOSITES.values()):
        if spec.options is not None and spec.options_type is not None:
            tables.setdefault(spec.options, spec.options_type)
    return tables


def specs() -> tuple[OptimizerSpec, ...]:
    """Every entry, in registration order (the same on every rank)."""
    return tuple(_REGISTRY.values())


def record_kinds() -> dict[str, str]:
    """The record kind (``schema.parse_key``) of every entry with records of its own -> its name."""
    return {s.record_kind: s.name for s in _REGISTRY.values() if s.record_kind}


def codebook_families() -> int:
    """How many codebooks the agreement learns (one per ``codebook_family`` of the entries)."""
    return 1 + max((s.codebook_family for s in _REGISTRY.values() if s.codebook_family is not None), default=-1)


def codebook_family(optim: Optimizer) -> int:
    """The codebook family of a built optimizer's entry (raises for one the agreement does not set)."""
    spec = spec_of(optim)
    if spec is None or spec.codebook_family is None:
        raise TypeError(f"{type(optim).__name__} has no agreed codebook family")
    return spec.codebook_family


def spec_of(optim: Optimizer) -> OptimizerSpec | None:
    """The entry that owns a built optimizer (by exact type), None if none does."""
    return next((s for s in _REGISTRY.values() if s.owns(optim)), None)
