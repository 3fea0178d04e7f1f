"""``[fault_tolerance]`` in a recipe: the run becomes torchtitan's FT trainer with gefen-titan's parts.

A recipe with the section (``recipes/llama_gefen_ft.toml``) is built as a
``GefenFaultTolerantTrainer.Config`` (torchtitan's ``FaultTolerantTrainer``
config with ``GefenTorchFTManager.Config`` as ``fault_tolerance``), its
optimizer as ``GefenFTOptimizersContainer.Config`` and its checkpoint as
``GefenFTCheckpointManager.Config``. The section's keys are the fields of
``GefenTorchFTManager.Config``; ``replica_id`` and ``group_size`` usually
come from the command line of each group (``docs/fault_tolerance.md``).

``check_fault_tolerance`` refuses, before any process group exists, what
no fault-tolerant run here can do. The ``gefen_titan.ft`` imports are
deferred: they load torchtitan's torchft experiment, which a recipe
without the section never needs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from gefen_titan.data.registry import dp_invariant_names, is_dp_invariant
from gefen_titan.recipe.errors import RecipeError

__all__ = ["SECTION", "as_fault_tolerant", "check_fault_tolerance", "ft_enabled", "lift_components", "replica_groups"]

SECTION = "fault_tolerance"


def as_fault_tolerant(config: Any) -> Any:
    """The base function's ``Trainer.Config`` as ``GefenFaultTolerantTrainer.Config`` (same values)."""
    from gefen_titan.ft.trainer import GefenFaultTolerantTrainer  # noqa: PLC0415 (see the module docstring)

    if isinstance(config, GefenFaultTolerantTrainer.Config):
        return config
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values.pop(SECTION, None)  # torchtitan's own FT config, if the base function made one: ours replaces it
    return GefenFaultTolerantTrainer.Config(**values)


def lift_components(config: Any) -> None:
    """Optimizer and checkpoint configs (torchtitan's or already gefen-titan's) as their
    FT variants, each lifted by its own ``Config.from_torchtitan``."""
    from gefen_titan.ft.checkpoint import GefenFTCheckpointManager  # noqa: PLC0415
    from gefen_titan.ft.optimizer import GefenFTOptimizersContainer  # noqa: PLC0415

    config.optimizer = GefenFTOptimizersContainer.config_class().from_torchtitan(config.optimizer)
    config.checkpoint = GefenFTCheckpointManager.Config.from_torchtitan(config.checkpoint)


def ft_enabled(config: Any) -> bool:
    ft = getattr(config, SECTION, None)
    return bool(ft is not None and ft.enable)


def replica_groups(config: Any) -> int:
    """How many replica groups share the data (1 without fault tolerance)."""
    return max(1, int(config.fault_tolerance.group_size)) if ft_enabled(config) else 1


def check_fault_tolerance(config: Any, path: str) -> None:
    if not ft_enabled(config):
        return
    ft, where = config.fault_tolerance, f"{path}: [{SECTION}]"
    if importlib.util.find_spec("torchft") is None:
        raise RecipeError(f"{where} enable: torchft is not installed: pip install 'gefen-titan[ft]' (torchft==0.2.0)")
    if ft.semi_sync_method is not None:
        raise RecipeError(f"{where} semi_sync_method: DiLoCo and LocalSGD are not supported with gefen-titan's "
                          "optimizers; leave it unset")
    if ft.group_size < 1 or not 0 <= ft.replica_id < ft.group_size:
        raise RecipeError(f"{where}: replica_id {ft.replica_id} must be in [0, group_size = {ft.group_size}): "
                          "set --fault_tolerance.group_size to the number of replica groups and "
                          "--fault_tolerance.replica_id to this group's index")
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise RecipeError(f"{where} min_replica_size {ft.min_replica_size} must be in [1, group_size = "
                          f"{ft.group_size}]")
    if config.parallelism.data_parallel_replicate_degree != 1:
        raise RecipeError(f"{where}: [parallelism] data_parallel_replicate_degree must be 1: the replica groups "
                          "are the replicate dimension")
    if not is_dp_invariant(config.dataloader):
        raise RecipeError(
            f"{where}: needs [dataloader] loader = {dp_invariant_names()}: a heal carries the data position, which "
            "must mean the same batches in every replica group (a DP-invariant loader's one global position)")
