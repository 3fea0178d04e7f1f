"""Gefen's registry entry: its factory, options, checks and state, as ``registry.OptimizerSpec``."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from gefen_titan.distributed import local
from gefen_titan.optim import cpu_step
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.checkpointing import StateAdapter
from gefen_titan.optim.kinds.gefen import cost as gefen_cost
from gefen_titan.optim.kinds.gefen import description as gefen_description
from gefen_titan.optim.kinds.gefen import factored
from gefen_titan.optim.kinds.gefen.options import GefenOptions
from gefen_titan.optim.kinds.gefen.per_rank import GefenPerRankAdapter
from gefen_titan.optim.kinds.gefen.sharded import GefenShardedAdapter
from gefen_titan.optim.kinds.gefen.validation import VALIDATION
from gefen_titan.optim.kinds.groups import split_options
from gefen_titan.optim.registry import OptimizerSpec, StateOptions

__all__ = ["GEFEN_OPTION_KEYS", "build_gefen", "spec"]

# Gefen constructor options that apply to the whole optimizer (the container
# fills them in from [optimizer.gefen] for every Gefen group); ``second_moment`` and
# ``cpu_step`` are gefen-titan's (the factored step: ``optim.kinds.gefen.factored``;
# which path runs the step on CPU tensors: ``optim.cpu_step``).
GEFEN_OPTION_KEYS = ("factored_v_2d", "force_1d_period_one", "period_one_substrings", "codebook_refresh_every",
                     "deterministic", "second_moment", "cpu_step")


def build_gefen(param_groups: list[dict[str, Any]], **factory_kwargs: Any) -> Optimizer:
    """Build ``gefen.Gefen`` from torchtitan-style param groups (see ``kinds.groups.split_options``); its factory kwargs
    are none (``gefenx.GEFEN_CONSTRUCTOR`` gives each option its place: ``optim.option_routes`` refuses them)."""
    groups, options = split_options(param_groups, GEFEN_OPTION_KEYS, "Gefen")
    if "period_one_substrings" in options:
        options["period_one_substrings"] = tuple(options["period_one_substrings"])
    mode = options.pop("cpu_step", "kernel")
    second_moment = options.pop("second_moment", "factored")  # GefenOptions.kwargs() resolves "auto"
    optim = gx.new_gefen(groups, **options, **factory_kwargs)
    cpu_step.install(optim, mode, "Gefen")
    if second_moment == "factored":
        factored.install(optim)  # offered each matrix first (gefenx.route_gefen_step)
    return optim


def _gefen_group_key_hint(key: str) -> str:
    """Hints for keys no constructor keyword of Gefen (those: ``optim.option_routes``)."""
    if key in ("beta1", "beta2"):
        return "; set betas = [beta1, beta2]"
    if key == "foreach":
        return "; Gefen has no foreach implementation"
    return ""


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
            gx.gefen_count_empty_shard_step(optim, p)


def spec() -> OptimizerSpec:
    """Gefen's entry (``optim.kinds.register_builtins`` registers it)."""
    return OptimizerSpec(
        name="Gefen",
        factory=build_gefen,
        owns=gx.is_gefen,
        # gefen-x's add_param_group reads lr/betas/eps/weight_decay and carries any
        # other key along unread; build_gefen turns ``fused`` into the constructor argument.
        group_keys=("lr", "betas", "eps", "weight_decay", "fused"),
        option_keys=GEFEN_OPTION_KEYS,
        options="gefen",
        options_type=GefenOptions,
        state=_gefen_state,
        record_kind=GefenShardedAdapter.record_kind,
        agreed_blocking=True,
        codebook_family=0,
        check_built=_check_gefen,
        after_agreed_step=_count_empty_shards,
        group_key_hint=_gefen_group_key_hint,
        checkpoint=gefen_description.description(),
        validation=VALIDATION,
        cost=gefen_cost.COST,
        constructor=gx.GEFEN_CONSTRUCTOR,
    )
