"""Gefen as a torchtitan optimizer.

torchtitan 0.3.0 resolves optimizer names through a hard-coded dict in
``OptimizersContainer._resolve_optimizer_factory``. ``GefenOptimizersContainer``
overrides that staticmethod to add ``"Gefen"`` and keeps everything else of the
stock container: one optimizer per model part (pipeline parallelism) and per
optimizer name, regex param groups (so a recipe can mix Gefen and AdamW), and
the LR schedulers, which drive ``group["lr"]`` exactly as for AdamW.

Its ``Config`` adds a shorthand that older torchtitan TOML users know
(``[optimizer] name = "Gefen"``, ``lr = ...``): with no explicit
``param_groups`` the shorthand becomes one catch-all group; with them, it is
the default of every group (a group states only what differs), so no key of
the section goes unused without ``check_param_groups`` saying so.
"""

from __future__ import annotations

import inspect
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

from gefen_titan.optim import gefen_state as gs

__all__ = ["GefenOptimizersContainer", "GROUP_DEFAULTS", "OPTIMIZER_NAMES", "ParamGroup", "build_gefen"]

# Keys torchtitan's container puts into every param group from
# ``implementation``. Gefen takes ``fused`` as a constructor argument (it would
# silently carry a group-level ``fused`` as an unused extra key) and has no
# foreach path.
_IMPL_KEYS = ("fused", "foreach")

# Gefen constructor options that apply to the whole optimizer (the container
# fills them in from [optimizer] for every Gefen group; see Config).
_GEFEN_OPTION_KEYS = (
    "factored_v_2d",
    "force_1d_period_one",
    "period_one_substrings",
    "codebook_refresh_every",
    "deterministic",
)

# Pinned off: FSDP2-sharded 2-D params always use the block second moment
# (Gefen cannot factor a shard), and keeping one layout at every world size
# (1 rank included) is what lets a checkpoint move between DP degrees.
FACTORED_V_2D = False


def build_gefen(param_groups: list[dict[str, Any]], **factory_kwargs: Any) -> Optimizer:
    """Build ``gefen.Gefen`` from torchtitan-style param groups.

    Groups carry ``param_names`` (canonical FQNs); Gefen stores them as the
    per-parameter state name, which is how checkpoints identify parameters.

    Gefen-wide options (``fused``, ``deterministic``, ...) are constructor
    arguments, not group options: they are taken from the first group (the
    container gives every Gefen group the same ones) and removed from all of
    them so they are not carried along as meaningless group keys.
    """
    from gefen import Gefen

    global_keys = _IMPL_KEYS + _GEFEN_OPTION_KEYS
    options: dict[str, Any] = {}
    groups = []
    for group in param_groups:
        group = dict(group)
        for key in global_keys:
            if key in group:
                value = group.pop(key)
                if key in options and options[key] != value:
                    raise ValueError(
                        f"Gefen option {key!r} must be the same for every Gefen "
                        f"param group (got {options[key]!r} and {value!r}); it is "
                        "a property of the optimizer, not of a group."
                    )
                options[key] = value
        names = group.pop("param_names", None)
        if names is not None:
            # Gefen takes names only as (name, tensor) pairs; a bare
            # "param_names" key would be ignored in favour of positional names.
            group["params"] = list(zip(names, group["params"], strict=True))
        groups.append(group)
    options.pop("foreach", None)
    # Gefen's fused path is CUDA-only and downgrades itself with a warning per
    # optimizer otherwise; decide here so CPU runs stay quiet.
    options["fused"] = bool(options.get("fused", False)) and torch.cuda.is_available()
    if "period_one_substrings" in options:
        options["period_one_substrings"] = tuple(options["period_one_substrings"])
    return Gefen(groups, **options, **factory_kwargs)


OPTIMIZER_NAMES = ("Gefen", "AdamW", "Adam")

# [optimizer] keys that are the defaults of every param group: ``name`` for a
# group without ``optimizer_name``, the others for a group of one of
# OPTIMIZER_NAMES whose ``optimizer_kwargs`` leave them out.
GROUP_DEFAULTS = ("name", "lr", "betas", "eps", "weight_decay")

# Group-level keys Gefen honours (gefen-x's ``add_param_group`` reads
# lr/betas/eps/weight_decay and carries any other key along unread;
# ``build_gefen`` turns ``fused`` into the constructor argument).
_GEFEN_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "fused")


def _group_keys(optimizer_name: str) -> tuple[str, ...]:
    """The ``optimizer_kwargs`` keys a group of this optimizer honours."""
    if optimizer_name == "Gefen":
        return _GEFEN_GROUP_KEYS
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[optimizer_name]
    return tuple(n for n in inspect.signature(cls).parameters if n != "params")


def _gefen_group_key_hint(key: str) -> str:
    if key in _GEFEN_OPTION_KEYS:
        return f"; it applies to every Gefen group: set optimizer.{key}"
    if key in ("beta1", "beta2"):
        return "; set betas = [beta1, beta2]"
    if key == "foreach":
        return "; Gefen has no foreach implementation"
    return "; Gefen constructor options go in optimizer.optimizer_factory_kwargs_by_name.Gefen"


@dataclass(kw_only=True, slots=True)
class ParamGroup(ParamGroupConfig):
    """torchtitan's ``ParamGroupConfig`` whose unset keys come from [optimizer]."""

    optimizer_name: str | None = None
    """Optimizer type for this group (None: [optimizer] name)."""

    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of this group's optimizer. lr, betas, eps and
    weight_decay left out come from [optimizer] (for Gefen, AdamW, Adam)."""


class GefenOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows ``"Gefen"``."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        param_groups: list[ParamGroup] = field(default_factory=list)
        """Per-parameter-group optimizers, first matching pattern wins (as in
        torchtitan). Empty: one catch-all group of ``name`` with ``lr``,
        ``betas``, ``eps``, ``weight_decay``; otherwise those are the
        defaults of each group (see ``resolved_param_groups``)."""

        name: Literal["Gefen", "AdamW", "Adam"] = "Gefen"
        """Optimizer of the catch-all group (no param_groups), else of each
        group without an optimizer_name."""

        lr: float = 8e-4
        """Learning rate (peak; the LR scheduler scales it); with param_groups,
        of each group that sets none."""

        betas: tuple[float, float] = (0.9, 0.95)
        """(Likewise the default of each group.)"""
        eps: float = 1e-8
        """(Likewise the default of each group.)"""
        weight_decay: float = 0.1
        """Decoupled (AdamW-style) weight decay (likewise a group default)."""

        force_1d_period_one: bool = True
        """Gefen: 1-D params (norm weights, biases) keep per-element state.
        They are tiny and set the LR stability ceiling, so on by default."""

        period_one_substrings: list[str] = field(default_factory=list)
        """Gefen: name substrings whose params keep per-element state
        (e.g. ``["tok_embeddings", "output"]``); costs 8 B/param on them."""

        codebook_refresh_every: int = 0
        """Gefen: relearn the codebook every N steps (0: learn once, step 1)."""

        deterministic: bool = False
        """Gefen: replica-exact arithmetic on CUDA at some speed cost."""

        blocking: Literal["agreed", "per_rank"] = "agreed"
        """How Gefen's block periods and codebook are chosen on the first step.

        ``"agreed"`` (default): from global statistics, the same on every rank
        (``gefen_titan.optim.blocking``), so the state is a function of the model
        alone: the same recipe trains the same optimizer at any mesh, and a
        checkpoint (format v2) resumes bit-exactly at any FSDP / TP / HSDP /
        pipeline layout. Costs one small all-gather and one 4096-bin
        all-reduce on step 1; periods are limited to divisors of the row
        length (and of the TP cuts), which can make blocks finer than
        gefen-x would choose (a few hundredths of a byte per parameter).
        ``"per_rank"``: gefen-x's own behaviour, each rank learns from its
        shard (format v1); resumes at another layout requantize, and TP
        layouts cannot be checkpointed."""

        max_tensor_parallel_degree: int = 1
        """Agreed blocking: the largest tensor-parallel degree a checkpoint of
        this run must resume at. Blocks then never cross the last-dim cut of
        any TP degree that divides it (the live layout's cuts always count).
        A resume at a TP degree not declared here is refused unless the
        periods happen to fit."""

        def __post_init__(self) -> None:
            if self.name not in OPTIMIZER_NAMES:
                raise ValueError(
                    f"optimizer.name must be one of {list(OPTIMIZER_NAMES)}, "
                    f"got {self.name!r}"
                )
            if self.codebook_refresh_every < 0:
                raise ValueError("optimizer.codebook_refresh_every must be >= 0")
            if self.blocking not in ("agreed", "per_rank"):
                raise ValueError(f"optimizer.blocking must be 'agreed' or 'per_rank', got {self.blocking!r}")
            if self.max_tensor_parallel_degree < 1:
                raise ValueError("optimizer.max_tensor_parallel_degree must be >= 1")
            if self.blocking == "agreed" and self.codebook_refresh_every > 0:
                raise ValueError(
                    "optimizer.codebook_refresh_every > 0 relearns the codebook on each rank from its own "
                    "gradient shard, which breaks agreed blocking; set it to 0, or set "
                    "optimizer.blocking = \"per_rank\"")
            if self.blocking == "agreed" and not self.force_1d_period_one:
                raise ValueError(
                    "optimizer.force_1d_period_one = false lets gefen-x block 1-D parameters across FSDP "
                    "shard cuts, which agreed blocking cannot align; keep it true, or set "
                    "optimizer.blocking = \"per_rank\"")

        def hyperparameters(self) -> dict[str, Any]:
            """kwargs of the catch-all group for ``name`` (Gefen-wide options
            are added by the container to every Gefen group)."""
            return {
                "lr": self.lr,
                "betas": tuple(self.betas),
                "eps": self.eps,
                "weight_decay": self.weight_decay,
            }

        def gefen_options(self) -> dict[str, Any]:
            return {
                "factored_v_2d": FACTORED_V_2D,
                "force_1d_period_one": self.force_1d_period_one,
                "period_one_substrings": tuple(self.period_one_substrings),
                "codebook_refresh_every": self.codebook_refresh_every,
                "deterministic": self.deterministic,
            }

        def resolved_param_groups(self) -> list[ParamGroupConfig]:
            """The groups the container builds, every key filled in.

            A group without ``optimizer_name`` is of ``name``; a group of
            Gefen, AdamW or Adam takes ``lr``, ``betas``, ``eps`` and
            ``weight_decay`` from this section where its ``optimizer_kwargs``
            leave them out. Other optimizers' groups (a base config's, e.g.
            DistMuon) are kept as they are.
            """
            if not self.param_groups:
                return [
                    ParamGroupConfig(
                        pattern=r".*",
                        optimizer_name=self.name,
                        optimizer_kwargs=self.hyperparameters(),
                    )
                ]
            groups = []
            for g in self.param_groups:
                name = g.optimizer_name or self.name
                kwargs = dict(g.optimizer_kwargs)
                if name in OPTIMIZER_NAMES:
                    kwargs = {**self.hyperparameters(), **kwargs}
                groups.append(ParamGroupConfig(pattern=g.pattern, optimizer_name=name, optimizer_kwargs=kwargs))
            return groups

        def unused_defaults(self) -> list[str]:
            """The ``GROUP_DEFAULTS`` keys that no param group takes."""
            if not self.param_groups:
                return []
            unused = []
            if all(g.optimizer_name for g in self.param_groups):
                unused.append("name")
            for key in GROUP_DEFAULTS[1:]:
                if not any((g.optimizer_name or self.name) in OPTIMIZER_NAMES and key not in g.optimizer_kwargs
                           for g in self.param_groups):
                    unused.append(key)
            return unused

        def check_param_groups(self) -> None:
            """Refuse group settings that would build an optimizer that ignores
            them: an optimizer no factory knows, an ``optimizer_kwargs`` key
            the group's optimizer does not read (torch and gefen-x keep unknown
            group keys without a word), factory kwargs for an optimizer no
            group uses."""
            names = set()
            for i, g in enumerate(self.resolved_param_groups()):
                where = f"param_groups[{i}]" if self.param_groups else "name"
                try:
                    GefenOptimizersContainer._resolve_optimizer_factory(g.optimizer_name)
                except NotImplementedError:
                    raise ValueError(
                        f"{where}: unknown optimizer {g.optimizer_name!r} (known: {', '.join(OPTIMIZER_NAMES)})"
                    ) from None
                names.add(g.optimizer_name)
                if g.optimizer_name not in OPTIMIZER_NAMES:
                    continue
                known = _group_keys(g.optimizer_name)
                for key in g.optimizer_kwargs:
                    if key not in known:
                        hint = _gefen_group_key_hint(key) if g.optimizer_name == "Gefen" else ""
                        raise ValueError(
                            f"{where} optimizer_kwargs: {g.optimizer_name} does not read {key!r} in a "
                            f"param group (it reads {', '.join(known)}){hint}"
                        )
            for name in self.optimizer_factory_kwargs_by_name:
                if name not in names:
                    raise ValueError(
                        f"optimizer_factory_kwargs_by_name: no param group uses {name!r} "
                        f"(the groups use {', '.join(sorted(names))})"
                    )

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        groups = config.resolved_param_groups()
        # Gefen-wide options come from the [optimizer] section even when the
        # recipe spells out param_groups, so every Gefen group agrees on them.
        groups = [
            ParamGroupConfig(
                pattern=g.pattern,
                optimizer_name=g.optimizer_name,
                optimizer_kwargs=(
                    {**config.gefen_options(), **g.optimizer_kwargs}
                    if g.optimizer_name == "Gefen"
                    else dict(g.optimizer_kwargs)
                ),
            )
            for g in groups
        ]
        base = OptimizersContainer.Config(
            param_groups=groups,
            implementation=config.implementation,
            optimizer_factory_kwargs_by_name=config.optimizer_factory_kwargs_by_name,
        )
        self.config = config
        super().__init__(base, model_parts=model_parts)
        for optim in self.gefen_optimizers:
            if gs.options(optim)["capturable"]:
                raise ValueError(
                    "Gefen capturable=True keeps its step counters on the device, and gefen_titan "
                    "checkpoints only host counters: remove capturable from "
                    "optimizer.optimizer_factory_kwargs_by_name")
        # Report the state size once it exists (Gefen allocates on step 1).
        # A flag, not a self-removing hook: torch iterates the hook dict.
        self._size_logged = False
        self.register_step_post_hook(_log_state_size_once)
        from gefen_titan.optim.state import AgreedStateAdapter, PerRankStateAdapter

        self.blocking = config.blocking
        if config.blocking == "agreed":
            from gefen_titan.optim.blocking import AgreedBlocking

            self._agreement: AgreedBlocking | None = AgreedBlocking(config.max_tensor_parallel_degree)
            # One hook for the container, not one per optimizer: every rank
            # must join the agreement's collectives, also a rank whose stage
            # holds no Gefen parameter.
            self.register_step_pre_hook(_agree_before_first_step)
            self.register_step_post_hook(_count_empty_shards)
            self._gefen_state: Any = AgreedStateAdapter(self.optimizers)
        else:
            self._agreement = None
            self._gefen_state = PerRankStateAdapter(self.optimizers)
        self._loading: Any = None  # the adapter reading the checkpoint being loaded

    # Checkpointing: Gefen state goes through the resharding adapters (compact,
    # any N->M); other optimizers keep torchtitan's flat FQN-keyed state.
    # Never run init_optim_state on Gefen: its zero-gradient step would learn
    # and freeze a codebook and periods from zeros.
    def state_dict(self) -> dict[str, Any]:
        loading = self._loading is not None
        result: dict[str, Any] = {}
        for optim in self._other_optimizers():
            init_optim_state(optim)
            flat = get_flat_optim_state_dict(optim)
            if loading:  # load into copies: a failed load must change nothing
                flat = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
            result.update(flat)
        result.update((self._loading or self._gefen_state).state_dict())
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        adapter = self._loading
        if adapter is None and self._gefen_state.optimizers:
            from gefen_titan.optim.state import GefenCheckpointError

            raise GefenCheckpointError(
                "Gefen state can only be loaded through GefenCheckpointManager (which reads the "
                "checkpoint's records first); set the recipe's [checkpoint] as usual")
        if adapter is not None:
            adapter.load_state_dict(state_dict)
            self._loading = None
        for optim in self._other_optimizers():
            init_optim_state(optim)
            load_flat_optim_state_dict(optim, state_dict)
        if self._agreement is not None:
            # A restored codebook means the agreement is in the checkpoint;
            # one that was saved before the first step still needs it. Every
            # rank must decide alike (ranks without Gefen params included).
            self._agreement.needed = not _any_rank(any(gs.codebook(o) is not None for o in self.gefen_optimizers))

    # LoadPreparer (gefen_titan.checkpoint.manager): GefenCheckpointManager calls these
    # on every rank around torchtitan's dcp.load.
    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str) -> None:
        """Pick the adapter for the checkpoint's format and let it plan the load."""
        from gefen_titan.optim.state import AgreedStateAdapter, PerRankStateAdapter, agree, checkpoint_blocking

        # Collective on every rank, also on ranks without Gefen parameters.
        has_gefen = bool(self._gefen_state.optimizers)
        blocking = checkpoint_blocking(checkpoint_id, metadata, prefix, has_gefen)
        error = None
        if has_gefen and blocking != self.blocking:
            error = (
                f"it was written with optimizer.blocking = \"{blocking}\" (format "
                f"v{2 if blocking == 'agreed' else 1}) and the recipe sets \"{self.blocking}\"; resume "
                f"with optimizer.blocking = \"{blocking}\" (or start the optimizer fresh with "
                "checkpoint.exclude_from_loading = [\"optimizer\"])")
        agree(error, f"cannot load Gefen optimizer state from {checkpoint_id}")
        adapter = AgreedStateAdapter(self.optimizers) if blocking == "agreed" else PerRankStateAdapter(self.optimizers)
        adapter.prepare_load(checkpoint_id, metadata, prefix)
        self._loading = adapter

    def abort_load(self) -> None:
        self._loading = None

    @property
    def snapshot_on_save(self) -> bool:
        return getattr(self._gefen_state, "snapshot_on_save", True)

    @snapshot_on_save.setter
    def snapshot_on_save(self, value: bool) -> None:
        if hasattr(self._gefen_state, "snapshot_on_save"):
            self._gefen_state.snapshot_on_save = value

    def _other_optimizers(self) -> list[Optimizer]:
        gefen = set(map(id, self._gefen_state.optimizers))
        return [o for o in self.optimizers if id(o) not in gefen]

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        if name == "Gefen":
            return build_gefen
        return OptimizersContainer._resolve_optimizer_factory(name)

    def state_bytes(self) -> tuple[int, int]:
        """(optimizer state bytes, parameter elements) held by this rank.

        Counts every tensor in every optimizer's per-param state (local shards
        of DTensors) plus Gefen's per-optimizer codebooks.
        """
        state_bytes = 0
        numel = 0
        for optim in self.optimizers:
            for group in optim.param_groups:
                for p in group["params"]:
                    numel += _local(p).numel()
            if gs.is_gefen(optim):
                state_bytes += sum(_local(t).nbytes for t in gs.state_tensors(optim))
            else:
                for group in optim.param_groups:
                    for p in group["params"]:
                        for value in optim.state.get(p, {}).values():
                            if isinstance(value, torch.Tensor):
                                state_bytes += _local(value).nbytes
        return state_bytes, numel

    @property
    def gefen_optimizers(self) -> list[Optimizer]:
        return [o for o in self.optimizers if gs.is_gefen(o)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _any_rank(flag: bool) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _agree_before_first_step(container: GefenOptimizersContainer, args: Any, kwargs: Any) -> None:
    container._agreement.maybe_agree(container.gefen_optimizers)


def _count_empty_shards(container: GefenOptimizersContainer, args: Any, kwargs: Any) -> None:
    for optim in container.gefen_optimizers:
        for _, p, _ in gs.named_params(optim):
            if p.grad is not None and _local(p).numel() == 0:
                gs.count_empty_shard_step(optim, p)


def _log_state_size_once(container: GefenOptimizersContainer, args: Any, kwargs: Any) -> None:
    from torchtitan.tools.logging import logger

    if container._size_logged:
        return
    container._size_logged = True
    state_bytes, numel = container.state_bytes()
    if numel:
        logger.info(
            f"Optimizer state on this rank: {state_bytes / 2**20:.2f} MiB for "
            f"{numel} param elements = {state_bytes / numel:.3f} bytes/param"
        )
