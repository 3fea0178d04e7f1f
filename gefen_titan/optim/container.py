"""Gefen as a torchtitan optimizer: ``GefenOptimizersContainer`` and its ``Config``.

torchtitan 0.3.0 resolves optimizer names through a hard-coded dict in
``OptimizersContainer._resolve_optimizer_factory``. ``GefenOptimizersContainer``
overrides that staticmethod to look names up in gefen-titan's registry
(``gefen_titan.optim.registry``: Gefen, AdamW, Adam) before torchtitan's, and
keeps everything else of the stock container: one optimizer per model part
(pipeline parallelism) and per optimizer name, regex param groups (so a recipe
can mix Gefen and AdamW), and the LR schedulers, which drive ``group["lr"]``
exactly as for AdamW.

Its ``Config`` adds a shorthand that older torchtitan TOML users know
(``[optimizer] name = "Gefen"``, ``lr = ...``): with no explicit
``param_groups`` the shorthand becomes one catch-all group (a key left unset
takes ``SHORTHAND_DEFAULTS``). With them, a group is what torchtitan makes of
it (``ParamGroupConfig``: "no implicit defaults"): a key its
``optimizer_kwargs`` leave out is its optimizer's own default (torch's for
AdamW and Adam, gefen-x's for Gefen and GefenMuon), unless the shorthand key
was *set* (not None), which then stands for every group that leaves it out.
So a torchtitan config moved to this container trains the same, and a set
key that no group takes is reported (``optim.param_groups``, whose functions
take the Config: it is data, with no methods of theirs). The Config holds
only keys every optimizer kind shares and the container's own
``[optimizer.blocking]`` table; each kind's options are a table of it
(``[optimizer.gefen]``, ``[optimizer.muon]``, ``[optimizer.hybrid]``), as
torchtitan nests a component's options in its own Config. Those fields are
generated from the registry, not written here. How (``optim.config_tables``):
each entry carries its table's name and class (``options``,
``options_type``); ``with_registered_tables``, under ``@dataclass``, adds
one ``field(default_factory=options_type)`` per registered table, so tyro
sees static fields (help: the options class's docstring); a kind registered
after import gets its table from ``config_class()``, a generated subclass,
through which the recipe layer builds ``[optimizer]``.

Checkpointing: each registered optimizer kind with state of its own shape
(Gefen) is saved and loaded through its ``StateAdapter``
(``gefen_titan.optim.checkpointing``); every other optimizer keeps torchtitan's flat
FQN-keyed state. The container is a ``LoadPreparer``: ``GefenCheckpointManager``
hands it the checkpoint's metadata before DCP reads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.utils import (
    get_flat_optim_state_dict,
    init_optim_state,
    load_flat_optim_state_dict,
)
from torchtitan.tools.logging import logger

from gefen_titan.checkpoint.errors import Verdict
from gefen_titan.distributed import any_rank
from gefen_titan.optim import config_tables, kinds, option_routes, param_groups, registry
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.blocking import AgreedBlocking
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.checkpointing import StateAdapter, kinds_refusal, read_load_context
from gefen_titan.optim.hybrid import RoutedGroup
from gefen_titan.optim.param_groups import GROUP_DEFAULTS, SHORTHAND_DEFAULTS
from gefen_titan.optim.state_size import state_bytes

__all__ = ["GefenOptimizersContainer", "GROUP_DEFAULTS", "SHORTHAND_DEFAULTS", "ParamGroup"]

# ``[optimizer] name``'s type (the recipe check and the command line list it) and the generated tables
# need the registered kinds when the Config is defined: the built-ins are registered here, explicitly
# (a second call, by a tool, does nothing). A kind registered later is looked up at run time.
kinds.register_builtins()
_REGISTERED = registry.names() + registry.composite_names()

# The container's own options tables (field -> options class); the kinds' come from the registry.
_OWN_TABLES = {"blocking": BlockingOptions}


@dataclass(kw_only=True, slots=True)
class ParamGroup(ParamGroupConfig):
    """torchtitan's ``ParamGroupConfig`` whose optimizer may come from [optimizer] name."""

    optimizer_name: str | None = None
    """Optimizer type for this group (None: [optimizer] name)."""

    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of this group's optimizer. A key left out is the
    optimizer's own default, except that of lr, betas, eps and weight_decay,
    those the optimizer takes from the shorthand (Gefen, AdamW, Adam: all
    four; GefenMuon: lr and weight_decay) come from [optimizer] where it
    sets them."""


class GefenOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows ``"Gefen"``."""

    @dataclass(kw_only=True, slots=True)
    @config_tables.with_registered_tables
    class Config(OptimizersContainer.Config):
        param_groups: list[ParamGroup] = field(default_factory=list)
        """Per-parameter-group optimizers, first matching pattern wins (as in
        torchtitan). Empty: one catch-all group of ``name`` with ``lr``,
        ``betas``, ``eps``, ``weight_decay``; otherwise each of those that is
        set stands for the groups that leave it out, and an unset one leaves
        them their optimizer's default (``param_groups.resolved_param_groups``)."""

        name: Literal[_REGISTERED] = "Gefen"
        """Optimizer of the catch-all group (no param_groups), else of each
        group without an optimizer_name: a name of ``gefen_titan.optim.registry``."""

        lr: float | None = None
        """Learning rate (peak; the LR scheduler scales it). Unset (None): 8e-4
        in the catch-all group; with param_groups, a set lr is that of each
        group that sets none, an unset one leaves those groups their
        optimizer's default (torch: 1e-3)."""

        betas: tuple[float, float] | None = None
        """Adam betas, set or unset as lr (catch-all: (0.9, 0.95); torch's
        default: (0.9, 0.999))."""
        eps: float | None = None
        """Adam eps, set or unset as lr (catch-all: 1e-8)."""
        weight_decay: float | None = None
        """Weight decay as the group's optimizer applies it (decoupled for
        Gefen and AdamW, coupled L2 for Adam), set or unset as lr (catch-all:
        0.1; torch's default: AdamW 0.01, Adam 0)."""

        blocking: BlockingOptions = field(default_factory=BlockingOptions)
        """``[optimizer.blocking]``: agreed or per-rank blocking (``mode``) and the TP degrees a checkpoint
        must resume at, container-wide (``optim.blocking_options``; older recipes' flat ``blocking`` and
        ``max_tensor_parallel_degree`` keys are read into it)."""

        # Each kind's options table is a field generated from its entry (``with_registered_tables``).

        def __post_init__(self) -> None:
            if registry.get(self.name) is None and registry.composite(self.name) is None:
                raise ValueError(f"optimizer.name must be one of {list(_REGISTERED)}, got {self.name!r}")
            for options in config_tables.tables_of(self, _OWN_TABLES).values():
                options.check_config(self)

        @staticmethod
        def flat_keys() -> dict[str, list[str]]:
            """A flat ``[optimizer]`` key of recipes written before the tables -> the ``table.field`` places
            it sets (``deterministic`` and ``cpu_step``: Gefen's and GefenMuon's), every registered table's."""
            return config_tables.flat_keys(_OWN_TABLES)

        @staticmethod
        def scalar_fields() -> dict[str, str]:
            """A table an older recipe gave a plain value -> the field it sets (``blocking``: ``mode``)."""
            return config_tables.scalar_fields(_OWN_TABLES)

        @classmethod
        def from_torchtitan(cls, stock: OptimizersContainer.Config) -> GefenOptimizersContainer.Config:
            """torchtitan's optimizer config (a base config function's) as this class.

            A single catch-all group of a registered optimizer that sets exactly
            lr, betas, eps and weight_decay (what torchtitan's ``default_adamw``
            builds) becomes ``name`` and the shorthand, set, so that
            ``[optimizer] name = "Gefen"`` replaces it instead of being shadowed
            by it, and trains with the same values. Any other groups are kept as
            they are, so each keeps its optimizer's defaults for the keys it
            leaves out, as in torchtitan. A config of ours (of another class,
            e.g. the plain one for the fault-tolerant variant) keeps its values.
            """
            if isinstance(stock, cls):
                return stock
            if isinstance(stock, GefenOptimizersContainer.Config):  # its kinds' tables copied, not shared
                return cls(**{f.name: dataclasses.replace(v) if dataclasses.is_dataclass(v := getattr(stock, f.name))
                              else v for f in dataclasses.fields(stock) if f.init})
            values: dict[str, Any] = {
                "implementation": stock.implementation,
                "optimizer_factory_kwargs_by_name": dict(stock.optimizer_factory_kwargs_by_name),
            }
            groups = list(stock.param_groups)
            if (len(groups) == 1 and groups[0].pattern == ".*" and registry.get(groups[0].optimizer_name) is not None
                    and set(groups[0].optimizer_kwargs) == set(registry.SHORTHAND_KEYS)):
                kw = groups[0].optimizer_kwargs
                values.update(name=groups[0].optimizer_name, lr=float(kw["lr"]), betas=tuple(kw["betas"]),
                              eps=float(kw["eps"]), weight_decay=float(kw["weight_decay"]))
            else:
                values["param_groups"] = groups
            return cls(**values)

    @classmethod
    def config_class(cls) -> type[Config]:
        """``cls.Config``, or its generated subclass with the tables of kinds registered after it was
        defined (``optim.config_tables.config_class``): build ``[optimizer]`` through it."""
        return config_tables.config_class(cls.Config)

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        # Before any optimizer exists: a gefen-x option given as a factory kwarg has its place elsewhere or is
        # refused (the recipe checks say the same; this is for a container built without them).
        option_routes.refuse_factory_kwargs(config.optimizer_factory_kwargs_by_name)
        # Optimizer-wide options come from the kind's own table even when the
        # recipe spells out param_groups, so every group of an optimizer agrees on them.
        groups = []
        for g in param_groups.resolved_param_groups(config):
            spec = registry.get(g.optimizer_name)
            kwargs = dict(g.optimizer_kwargs)
            if spec is not None and spec.options is not None:
                options = config_tables.table(config, spec.options).kwargs(config)
                kwargs = {**{k: options[k] for k in spec.option_keys}, **kwargs}
            groups.append(dataclasses.replace(g, optimizer_kwargs=kwargs))
        # A composite name (GefenMuonHybrid) routes by module: exact-name patterns from the parts.
        composite = registry.composite(config.name) if not config.param_groups else None
        if composite is not None:
            groups = composite.bind(groups, model_parts)
        base = OptimizersContainer.Config(
            param_groups=groups,
            implementation=config.implementation,
            optimizer_factory_kwargs_by_name=config.optimizer_factory_kwargs_by_name,
        )
        self.config = config
        super().__init__(base, model_parts=model_parts)
        for optim in self.optimizers:
            spec = registry.spec_of(optim)
            if spec is None and gx.is_gefenx_optimizer(optim):
                raise ValueError(
                    f"{type(optim).__name__} is a subclass of Gefen that gefen-titan has no registry entry for: "
                    "its state is not Gefen's, so it can be neither agreed nor checkpointed as Gefen. Use "
                    f"optimizer name \"Gefen\", or register {type(optim).__name__} in gefen_titan.optim.registry "
                    "(a factory, a state adapter and its records)")
            if spec is not None and spec.check_built is not None:
                spec.check_built(optim)
            if spec is not None and spec.needs_agreed_blocking and config.blocking.mode != "agreed":
                raise ValueError(f"{spec.name} {spec.needs_agreed_blocking}")
        # Report the state size once it exists (step 1). A flag, not a self-removing hook: torch iterates the hooks.
        self._size_logged = False
        self.register_step_post_hook(self._log_state_size_once)

        self.blocking = config.blocking.mode
        self.agreement: AgreedBlocking | None = None  # None: per-rank blocking (a heal copies `needed`)
        if self.blocking == "agreed":
            self.agreement = AgreedBlocking(config.blocking.max_tensor_parallel_degree,
                                            family_of=registry.codebook_family,
                                            families=registry.codebook_families())
            # One hook for the container, not one per optimizer: every rank must join the agreement's
            # collectives, also a rank whose stage holds no Gefen parameter.
            self.register_step_pre_hook(self._agree_before_first_step)
            self.register_step_post_hook(self._after_agreed_step)
        # One adapter per registered kind with state of its own, built on
        # every rank (also where no optimizer of the kind lives: a pipeline
        # stage), in registry order, because their saves and loads are
        # collective.
        state_options = registry.StateOptions(blocking=self.blocking)
        self._states: list[StateAdapter] = [
            spec.state([o for o in self.optimizers if spec.owns(o)], state_options)
            for spec in registry.specs() if spec.state is not None
        ]
        self._loading = False  # between prepare_load and load_state_dict / abort_load
        self._checkpoint_id = ""  # prepare_load's, for load_state_dict's message

    # Checkpointing. Never run init_optim_state on Gefen: its zero-gradient
    # step would learn and freeze a codebook and periods from zeros.
    def state_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for optim in self._flat_optimizers():
            init_optim_state(optim)
            flat = get_flat_optim_state_dict(optim)
            if self._loading:  # load into copies: a failed load must change nothing
                flat = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
            result.update(flat)
        for state in self._states:
            result.update(state.state_dict())
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Every adapter checks and stages before any commits: a refusal by
        # one (on every rank) must leave the others' live state untouched.
        # One verdict for the phase: the adapters note, every rank settles once.
        verdict = Verdict()
        try:
            for state in self._states:
                state.stage_load(state_dict, verdict)
            verdict.settle(f"cannot load optimizer state from {self._checkpoint_id}")
        except BaseException:
            self.abort_load()
            raise
        for state in self._states:
            state.commit_load()
        self._loading = False
        for optim in self._flat_optimizers():
            init_optim_state(optim)
            load_flat_optim_state_dict(optim, state_dict)
        if self.agreement is not None:
            # A restored codebook means the agreement is in the checkpoint;
            # one that was saved before the first step still needs it. Every
            # rank must decide alike (ranks without Gefen params included).
            self.agreement.needed = not any_rank(any(gx.codebook(o) is not None for o in self.agreed_optimizers))

    # LoadPreparer (gefen_titan.checkpoint.manager): GefenCheckpointManager
    # calls these on every rank around torchtitan's dcp.load.
    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str) -> None:
        self._loading, self._checkpoint_id = True, checkpoint_id
        # One small collective read of every kind's records, shared by every check below; the checks
        # are local and note their refusal in one verdict, settled once on every rank.
        verdict = Verdict()
        ctx = read_load_context(checkpoint_id, metadata, prefix, verdict)
        if verdict.ok:
            # Every live parameter's kind, the flat ones (AdamW, Adam) too; composites say what to set.
            live = {fqn: spec.name for o in self.optimizers if (spec := registry.spec_of(o)) is not None
                    and spec.state is not None for fqn, _, _ in gx.named_params(o)}
            for o in self._flat_optimizers():
                live.update({fqn: type(o).__name__ for g in o.param_groups for fqn in g.get("param_names", ())})
            composites = [registry.composite(n) for n in registry.composite_names()]
            verdict.refuse(kinds_refusal(ctx, live, registry.record_kinds(), hint=lambda was, now: "; ".join(
                h for c in composites if (h := c.kind_hint(self.config, was, now)))))
        for state in self._states:
            state.prepare_load(ctx, verdict)
        if verdict.ok:  # what the checkpoint alone says (load_checks), as ckpt verify says it
            verdict.refuse(ctx.records_refusal)
        verdict.settle(f"cannot load optimizer state from {checkpoint_id}")

    def abort_load(self) -> None:
        self._loading = False
        for state in self._states:
            state.abort_load()

    # SnapshotsOnSave (gefen_titan.checkpoint.manager): async saves write
    # after later steps have changed the state in place.
    @property
    def snapshot_on_save(self) -> bool:
        return all(state.snapshot_on_save for state in self._states)

    @snapshot_on_save.setter
    def snapshot_on_save(self, value: bool) -> None:
        for state in self._states:
            state.snapshot_on_save = value

    def _flat_optimizers(self) -> list[Optimizer]:
        """The optimizers checkpointed with torchtitan's flat state dict."""
        return [o for o in self.optimizers if (s := registry.spec_of(o)) is None or s.state is None]

    @staticmethod
    def _build_param_groups(model: torch.nn.Module, param_group_configs: list[ParamGroupConfig],
                            impl_kwargs: dict[str, Any]) -> tuple[dict[str, list[dict]], dict[str, list[str]]]:
        """torchtitan's, except that a routed group (a composite's: exact names;
        its log line gives their count) that claims nothing in this model part
        is left out: a pipeline stage may hold no parameter of a routed set."""
        left, configs = [n for n, p in model.named_parameters() if p.requires_grad], []
        for g in param_group_configs:  # first match wins, as torchtitan claims them
            pattern = re.compile(g.pattern)
            rest = [n for n in left if not pattern.search(n)]
            configs += [g] if len(rest) < len(left) or not isinstance(g, RoutedGroup) else []
            left = rest
        return OptimizersContainer._build_param_groups(model, configs, impl_kwargs)  # noqa: SLF001

    def _log_optimizer(self, optimizer: Optimizer, part_idx: int, patterns: list[str]) -> None:
        short = [p if len(p) <= 100 else f"{p[:60]}... ({p.count('|') + 1} exact names)" for p in patterns]
        super()._log_optimizer(optimizer, part_idx, short)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        return param_groups.resolve_factory(name)  # the registry's, then torchtitan's own dict (DistMuon)

    def state_bytes(self) -> tuple[int, int]:
        """(optimizer state bytes, parameter elements) held by this rank (``optim.state_size``)."""
        return state_bytes(self.optimizers)

    def optimizers_of(self, name: str) -> list[Optimizer]:
        """The optimizers of registry entry ``name`` (its ``owns``: by exact type)."""
        spec = registry.get(name)
        if spec is None:
            raise KeyError(f"no registered optimizer {name!r} (registered: {', '.join(registry.names())})")
        return [o for o in self.optimizers if spec.owns(o)]

    def step_stats(self, name: str) -> list[Any]:
        """Each optimizer of entry ``name``'s step statistics on this rank (its ``step_stats``; benchmarks)."""
        optimizers = self.optimizers_of(name)  # raises for a name no entry has
        stats = registry.get(name).step_stats
        return [stats(o) for o in optimizers] if stats is not None else []

    @property
    def agreed_optimizers(self) -> list[Optimizer]:
        """The optimizers whose periods and codebook the first step's agreement sets."""
        return [o for o in self.optimizers if (s := registry.spec_of(o)) is not None and s.agreed_blocking]

    # ------------------------------------------------------------------ hooks
    def _agree_before_first_step(self, container: OptimizersContainer, args: Any, kwargs: Any) -> None:
        self.agreement.maybe_agree(self.agreed_optimizers)

    def _after_agreed_step(self, container: OptimizersContainer, args: Any, kwargs: Any) -> None:
        for optim in self.optimizers:
            spec = registry.spec_of(optim)
            if spec is not None and spec.after_agreed_step is not None:
                spec.after_agreed_step(optim)

    def _log_state_size_once(self, container: OptimizersContainer, args: Any, kwargs: Any) -> None:
        if self._size_logged:
            return
        self._size_logged = True
        state_bytes, numel = self.state_bytes()
        if numel:
            logger.info(
                f"Optimizer state on this rank: {state_bytes / 2**20:.2f} MiB for "
                f"{numel} param elements = {state_bytes / numel:.3f} bytes/param"
            )
