"""The optimizers a recipe can name, and what gefen-titan knows about each.

torchtitan 0.3.0 resolves ``optimizer_name`` through a hard-coded dict
(``OptimizersContainer._resolve_optimizer_factory``: Adam, AdamW, DistMuon).
``GefenOptimizersContainer`` looks names up here first and falls back to
torchtitan's dict for the rest (DistMuon, and whatever a later torchtitan
adds). An entry (``OptimizerSpec``) is everything the container, the recipe
checks and the checkpoint need to know about one optimizer, so a new Gefen
variant is one ``register`` call plus its state type and records:

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
  ``optimizer.muon``: an attribute of the container's Config, a dataclass whose
  ``kwargs()`` are the ``option_keys``), None for none;
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
  (``checkpoint.kinds.KindDescription``, built by the kind's own files:
  its key kinds, its records' checks, its rows in ``ckpt inspect``, its
  ``verify`` summary and non-negative tensors, why ``convert`` refuses it).
  ``register`` registers it with ``checkpoint.kinds``, where the load's
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

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from gefen_titan.checkpoint import gefen_muon_records, gefen_records, kinds
from gefen_titan.checkpoint.kinds import KindDescription
from gefen_titan.distributed import local
from gefen_titan.optim import cpu_step, hybrid
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.checkpointing import StateAdapter
from gefen_titan.optim.checkpointing.gefen_muon_sharded import GefenMuonShardedAdapter
from gefen_titan.optim.checkpointing.gefen_per_rank import GefenPerRankAdapter
from gefen_titan.optim.checkpointing.gefen_sharded import GefenShardedAdapter
from gefen_titan.optim.checkpointing.gefen_validation import VALIDATION as GEFEN_VALIDATION
from gefen_titan.optim.kind_validation import KindValidation
from gefen_titan.optim.muon import DEFAULT_BUCKET_MIB, ShardedMuonStep
from gefen_titan.optim.state_cost import StateCost, dense

__all__ = ["GEFEN_OPTION_KEYS", "MUON_OPTION_KEYS", "SHORTHAND_KEYS", "CompositeSpec", "OptimizerSpec", "StateOptions",
           "build_gefen", "build_gefen_muon", "codebook_families", "codebook_family", "composite", "composite_names",
           "get", "names", "record_kinds", "register", "register_composite", "spec_of", "specs", "unregister"]

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


_REGISTRY: dict[str, OptimizerSpec] = {}
_COMPOSITES: dict[str, CompositeSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"optimizer {spec.name!r} is already registered")
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


# ------------------------------------------------------------------ built-ins
# Gefen constructor options that apply to the whole optimizer (the container
# fills them in from [optimizer.gefen] for every Gefen group); ``cpu_step`` is
# gefen-titan's (which path runs the step on CPU tensors: ``optim.cpu_step``).
GEFEN_OPTION_KEYS = ("factored_v_2d", "force_1d_period_one", "period_one_substrings", "codebook_refresh_every",
                     "deterministic", "cpu_step")
# Keys torchtitan's container puts into every param group from
# ``implementation``. Gefen takes ``fused`` as a constructor argument (it would
# silently carry a group-level ``fused`` as an unused extra key) and has no
# foreach path.
_IMPL_KEYS = ("fused", "foreach")


def _split_options(param_groups: list[dict[str, Any]], option_keys: tuple[str, ...], name: str
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(groups, constructor options) from torchtitan-style param groups.

    Groups carry ``param_names`` (canonical FQNs); gefen-x stores them,
    lowercased, as the per-parameter state name, so they are also kept as
    they are under ``gefenx.FQNS_KEY``, which is how checkpoints identify
    parameters (``gefenx.named_params``).

    Optimizer-wide options (``fused``, ``deterministic``, ...) are constructor
    arguments, not group options: they are taken from the first group (the
    container gives every group of the optimizer the same ones) and removed
    from all of them so they are not carried along as meaningless group keys.
    """
    options: dict[str, Any] = {}
    groups = []
    for group in param_groups:
        group = dict(group)
        for key in _IMPL_KEYS + option_keys:
            if key in group:
                value = group.pop(key)
                if key in options and options[key] != value:
                    raise ValueError(
                        f"{name} option {key!r} must be the same for every {name} "
                        f"param group (got {options[key]!r} and {value!r}); it is "
                        "a property of the optimizer, not of a group."
                    )
                options[key] = value
        names_ = group.pop("param_names", None)
        if names_ is not None:
            # gefen-x takes names only as (name, tensor) pairs; a bare
            # "param_names" key would be ignored in favour of positional names.
            group["params"] = list(zip(names_, group["params"], strict=True))
            group[gx.FQNS_KEY] = list(names_)  # gefen-x lowercases its own copy (gefenx.named_params)
        groups.append(group)
    options.pop("foreach", None)
    # gefen-x's fused path is CUDA-only and downgrades itself with a warning per
    # optimizer otherwise; decide here so CPU runs stay quiet.
    options["fused"] = bool(options.get("fused", False)) and torch.cuda.is_available()
    return groups, options


def build_gefen(param_groups: list[dict[str, Any]], **factory_kwargs: Any) -> Optimizer:
    """Build ``gefen.Gefen`` from torchtitan-style param groups (see ``_split_options``); its factory kwargs
    are none (``gefenx.GEFEN_CONSTRUCTOR`` gives each option its place: ``optim.option_routes`` refuses them)."""
    groups, options = _split_options(param_groups, GEFEN_OPTION_KEYS, "Gefen")
    if "period_one_substrings" in options:
        options["period_one_substrings"] = tuple(options["period_one_substrings"])
    mode = options.pop("cpu_step", "kernel")
    optim = gx.new_gefen(groups, **options, **factory_kwargs)
    cpu_step.install(optim, mode, "Gefen")
    return optim


def _gefen_group_key_hint(key: str) -> str:
    """Hints for keys no constructor keyword of Gefen (those: ``optim.option_routes``)."""
    if key in ("beta1", "beta2"):
        return "; set betas = [beta1, beta2]"
    if key == "foreach":
        return "; Gefen has no foreach implementation"
    return ""


def _torch_optimizer(cls: type[Optimizer], cost: StateCost) -> OptimizerSpec:
    return OptimizerSpec(name=cls.__name__, factory=cls, owns=lambda optim: type(optim) is cls,
                         group_keys=tuple(n for n in inspect.signature(cls).parameters if n != "params"), cost=cost)


def _gefen_state(optimizers: list[Optimizer], options: StateOptions) -> StateAdapter:
    """The run's blocking picks the format it writes and the one it loads (a checkpoint
    of the other blocking is refused: its state could not be what this run keeps)."""
    if options.blocking == "agreed":
        return GefenShardedAdapter(optimizers)
    return GefenPerRankAdapter(optimizers)


def _check_gefen(optim: Optimizer) -> None:
    if gx.options(optim)["capturable"]:
        raise ValueError(
            "Gefen capturable=True keeps its step counters on the device, and gefen_titan "
            "checkpoints only host counters: remove capturable from "
            "optimizer.optimizer_factory_kwargs_by_name")


def _count_empty_shards(optim: Optimizer) -> None:
    """Gefen keeps no state for an empty local shard, so it does not count its steps:
    the container does, for the records (which must agree on every rank)."""
    for _, p, _ in gx.named_params(optim):
        if p.grad is not None and local(p).numel() == 0:
            gx.count_empty_shard_step(optim, p)


register(OptimizerSpec(
    name="Gefen",
    factory=build_gefen,
    owns=gx.is_gefen,
    # gefen-x's add_param_group reads lr/betas/eps/weight_decay and carries any
    # other key along unread; build_gefen turns ``fused`` into the constructor argument.
    group_keys=("lr", "betas", "eps", "weight_decay", "fused"),
    option_keys=GEFEN_OPTION_KEYS,
    options="gefen",
    state=_gefen_state,
    record_kind=GefenShardedAdapter.record_kind,
    agreed_blocking=True,
    codebook_family=0,
    check_built=_check_gefen,
    after_agreed_step=_count_empty_shards,
    group_key_hint=_gefen_group_key_hint,
    checkpoint=gefen_records.description(),
    validation=GEFEN_VALIDATION,
    cost=gx.STATE_COST,
    constructor=gx.GEFEN_CONSTRUCTOR,
))

# GefenMuon options the container fills in from [optimizer.muon]: gefen-x's
# ``deterministic``, the sharded step's bucket size and ``cpu_step`` (not gefen-x's).
MUON_OPTION_KEYS = ("deterministic", "bucket_mib", "cpu_step")


def build_gefen_muon(param_groups: list[dict[str, Any]], **factory_kwargs: Any) -> Optimizer:
    """Build ``gefen.GefenMuon`` from torchtitan-style param groups (see ``_split_options``).

    Its hyperparameters are group keys (``optimizer_kwargs``); what a group
    leaves out is gefen-x's default. Its factory kwargs take no option
    (``gefenx.MUON_CONSTRUCTOR`` gives each its place, or refuses it: those
    that make its arithmetic depend on the layout or the machine,
    ``gefenx.MUON_REFUSED``, by every route).
    Its ``step()`` is the sharded step (``gefen_titan.optim.muon``), never
    gefen-x's own.
    """
    # A 3-D parameter is a grouped experts' weight (E, out, in): one Muon matrix per expert (optim.muon.matrices).
    not_matrices = [f"{name} {tuple(p.shape)}" for g in param_groups
                    for name, p in zip(g.get("param_names", ()), g["params"]) if p.dim() not in (2, 3)]
    if not_matrices:
        raise ValueError(
            f"GefenMuon steps matrices only (a grouped experts' weight (E, out, in) as a matrix per expert), "
            f"and its param group matches "
            f"{len(not_matrices)} other parameter(s) ({', '.join(not_matrices[:3])}"
            f"{' ...' if len(not_matrices) > 3 else ''}): narrow the GefenMuon "
            "pattern in [[optimizer.param_groups]], or match those parameters in an earlier group for Gefen")
    groups, options = _split_options(param_groups, MUON_OPTION_KEYS, "GefenMuon")
    bucket_mib = options.pop("bucket_mib", DEFAULT_BUCKET_MIB)
    mode = options.pop("cpu_step", "kernel")
    if not bucket_mib > 0:
        raise ValueError(f"optimizer.muon.bucket_mib must be > 0, got {bucket_mib!r}")
    optim = gx.new_gefen_muon(groups, lambda o: ShardedMuonStep(o, bucket_bytes=int(bucket_mib * 2**20)),
                              **options, **factory_kwargs)
    cpu_step.install(optim, mode, "GefenMuon")
    return optim


def _muon_group_key_hint(key: str) -> str:
    """Hints for keys no constructor keyword of GefenMuon (those: ``optim.option_routes``)."""
    if key in ("betas", "beta1", "beta2"):
        return "; GefenMuon's momentum coefficient is 'momentum'"
    return ""


def _check_gefen_muon(optim: Optimizer) -> None:
    refused = gx.muon_refused(optim)
    if refused:
        raise ValueError("; ".join(f"GefenMuon {k} is not supported: {gx.MUON_REFUSED[k]}" for k in refused))


# exp_avg and exp_avg_sq like the parameter, and an fp32 step (amsgrad's max_exp_avg_sq is not counted).
register(_torch_optimizer(torch.optim.AdamW, dense(2, 4)))
register(_torch_optimizer(torch.optim.Adam, dense(2, 4)))
register(OptimizerSpec(
    name="GefenMuon",
    factory=build_gefen_muon,
    owns=gx.is_gefen_muon,
    group_keys=(*gx.MUON_GROUP_KEYS, "fused"),
    option_keys=MUON_OPTION_KEYS,
    options="muon",
    state=lambda optimizers, options: GefenMuonShardedAdapter(optimizers),
    record_kind=GefenMuonShardedAdapter.record_kind,
    agreed_blocking=True,
    codebook_family=1,
    # Its sharded step counts its empty shards' steps itself.
    needs_agreed_blocking=("needs optimizer.blocking = \"agreed\": its sharded step cuts the momentum along the "
                           "parameter's shards, which needs blocks that no shard cut crosses and one codebook for "
                           "the job"),
    check_built=_check_gefen_muon,
    group_key_hint=_muon_group_key_hint,
    # eps is the Newton-Schulz normalisation floor here (default 1e-7), not Adam's.
    shorthand_keys=("lr", "weight_decay"),
    step_stats=lambda optim: gx.sharded_step(optim).stats,
    checkpoint=gefen_muon_records.DESCRIPTION,
    cost=gx.MUON_STATE_COST,
    constructor=gx.MUON_CONSTRUCTOR,
))

register_composite(CompositeSpec(
    name=hybrid.NAME,
    param_groups=hybrid.param_groups,
    bind=hybrid.bind,
    check=hybrid.check,
    option_keys=hybrid.OPTION_KEYS,
    refused_keys=hybrid.REFUSED,
    kind_hint=hybrid.kind_hint,
    options="hybrid",
))
