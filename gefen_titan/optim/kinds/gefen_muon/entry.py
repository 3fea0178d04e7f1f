"""GefenMuon's registry entry: its factory (the sharded step), options, checks and state."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from gefen_titan.optim import cpu_step
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.kinds.gefen_muon import cost as muon_cost
from gefen_titan.optim.kinds.gefen_muon import description as muon_description
from gefen_titan.optim.kinds.gefen_muon.options import MuonOptions
from gefen_titan.optim.kinds.gefen_muon.sharded import GefenMuonShardedAdapter
from gefen_titan.optim.kinds.groups import split_options
from gefen_titan.optim.muon import DEFAULT_BUCKET_MIB, ShardedMuonStep
from gefen_titan.optim.registry import OptimizerSpec

__all__ = ["MUON_OPTION_KEYS", "build_gefen_muon", "spec"]

# GefenMuon options the container fills in from [optimizer.muon]: gefen-x's
# ``deterministic``, the sharded step's bucket size and ``cpu_step`` (not gefen-x's).
MUON_OPTION_KEYS = ("deterministic", "bucket_mib", "cpu_step")


def build_gefen_muon(param_groups: list[dict[str, Any]], **factory_kwargs: Any) -> Optimizer:
    """Build ``gefen.GefenMuon`` from torchtitan-style param groups (see ``kinds.groups.split_options``).

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
            "pattern in [[optimizer.param_groups]], or match those parameters in an earlier group of another "
            "optimizer")
    groups, options = split_options(param_groups, MUON_OPTION_KEYS, "GefenMuon")
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


def spec() -> OptimizerSpec:
    """GefenMuon's entry (``optim.kinds.register_builtins`` registers it)."""
    return OptimizerSpec(
        name="GefenMuon",
        factory=build_gefen_muon,
        owns=gx.is_gefen_muon,
        group_keys=(*gx.MUON_GROUP_KEYS, "fused"),
        option_keys=MUON_OPTION_KEYS,
        options="muon",
        options_type=MuonOptions,
        state=lambda optimizers, options: GefenMuonShardedAdapter(optimizers),
        record_kind=GefenMuonShardedAdapter.record_kind,
        agreed_blocking=True,
        codebook_family=1,
        # Its sharded step counts its empty shards' steps itself.
        needs_agreed_blocking=("needs optimizer.blocking.mode = \"agreed\": its sharded step cuts the momentum "
                               "along the parameter's shards, which needs blocks that no shard cut crosses and one "
                               "codebook for the job"),
        check_built=_check_gefen_muon,
        group_key_hint=_muon_group_key_hint,
        # eps is the Newton-Schulz normalisation floor here (default 1e-7), not Adam's.
        shorthand_keys=("lr", "weight_decay"),
        step_stats=lambda optim: gx.muon_sharded_step(optim).stats,
        checkpoint=muon_description.DESCRIPTION,
        cost=muon_cost.COST,
        constructor=gx.MUON_CONSTRUCTOR,
    )
