"""Gefen as a torchtitan optimizer.

torchtitan 0.3.0 resolves optimizer names through a hard-coded dict in
``OptimizersContainer._resolve_optimizer_factory``. ``GefenOptimizersContainer``
overrides that staticmethod to add ``"Gefen"`` and keeps everything else of the
stock container: one optimizer per model part (pipeline parallelism) and per
optimizer name, regex param groups (so a recipe can mix Gefen and AdamW), and
the LR schedulers, which drive ``group["lr"]`` exactly as for AdamW.

Its ``Config`` adds a shorthand that older torchtitan TOML users know
(``[optimizer] name = "Gefen"``, ``lr = ...``): with no explicit
``param_groups`` the shorthand becomes one catch-all group.
"""

from __future__ import annotations

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

__all__ = ["GefenOptimizersContainer", "build_gefen", "OPTIMIZER_NAMES"]

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


class GefenOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows ``"Gefen"``."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: Literal["Gefen", "AdamW", "Adam"] = "Gefen"
        """Optimizer of the catch-all group used when ``param_groups`` is empty."""

        lr: float = 8e-4
        """Learning rate (peak; the LR scheduler scales it)."""

        betas: tuple[float, float] = (0.9, 0.95)
        eps: float = 1e-8
        weight_decay: float = 0.1
        """Decoupled (AdamW-style) weight decay."""

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

        def __post_init__(self) -> None:
            if self.name not in OPTIMIZER_NAMES:
                raise ValueError(
                    f"optimizer.name must be one of {list(OPTIMIZER_NAMES)}, "
                    f"got {self.name!r}"
                )
            if self.codebook_refresh_every < 0:
                raise ValueError("optimizer.codebook_refresh_every must be >= 0")

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
            if self.param_groups:
                return list(self.param_groups)
            return [
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name=self.name,
                    optimizer_kwargs=self.hyperparameters(),
                )
            ]

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
        # Report the state size once it exists (Gefen allocates on step 1).
        self._size_hook = self.register_step_post_hook(_log_state_size_once)
        from .reshard import GefenStateAdapter

        self._gefen_state = GefenStateAdapter(self.optimizers)

    # Checkpointing: Gefen state goes through the resharding adapter (compact,
    # any N->M); other optimizers keep torchtitan's flat FQN-keyed state.
    # Never run init_optim_state on Gefen: its zero-gradient step would learn
    # and freeze a codebook and periods from zeros.
    def state_dict(self) -> dict[str, Any]:
        loading = self._gefen_state._plan is not None
        result: dict[str, Any] = {}
        for optim in self._other_optimizers():
            init_optim_state(optim)
            flat = get_flat_optim_state_dict(optim)
            if loading:  # load into copies: a failed load must change nothing
                flat = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
            result.update(flat)
        result.update(self._gefen_state.state_dict())
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._gefen_state.load_state_dict(state_dict)
        for optim in self._other_optimizers():
            init_optim_state(optim)
            load_flat_optim_state_dict(optim, state_dict)

    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str) -> None:
        """Called by GefenCheckpointManager on every rank before ``dcp.load``."""
        self._gefen_state.prepare_load(checkpoint_id, metadata, prefix)

    def abort_load(self) -> None:
        self._gefen_state.abort_load()

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
                    for value in optim.state.get(p, {}).values():
                        if isinstance(value, torch.Tensor):
                            state_bytes += _local(value).nbytes
            codebook = getattr(optim, "_gefen_codebook", None)
            if isinstance(codebook, torch.Tensor):
                state_bytes += codebook.nbytes
        return state_bytes, numel

    @property
    def gefen_optimizers(self) -> list[Optimizer]:
        from gefen import Gefen

        return [o for o in self.optimizers if isinstance(o, Gefen)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _log_state_size_once(container: GefenOptimizersContainer, args: Any, kwargs: Any) -> None:
    from torchtitan.tools.logging import logger

    container._size_hook.remove()
    state_bytes, numel = container.state_bytes()
    if numel:
        logger.info(
            f"Optimizer state on this rank: {state_bytes / 2**20:.2f} MiB for "
            f"{numel} param elements = {state_bytes / numel:.3f} bytes/param"
        )
