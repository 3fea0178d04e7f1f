"""The cross-section checks ``finish_recipe`` runs on the final config.

Each refuses, with a ``RecipeError`` that names the recipe keys, a config no
run can use, before any process group exists (torchtitan would assert the
same later, on some ranks, or not at all): a mesh whose degrees do not
multiply to the world size or whose expert-parallel degree cannot split
the ranks or the experts (``validate_mesh``), a global-order loader
without a global batch that splits into equal rank slices
(``check_global_order_batch``), and an ``[optimizer]`` key that has no effect
or a group key its optimizer ignores (``check_optimizer``). They need the
values the command line may still change, so they run after it.
"""

from __future__ import annotations

import os
from typing import Any

from gefen_titan.data.registry import dp_invariant_names, is_dp_invariant
from gefen_titan.optim import param_groups
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.recipe.errors import RecipeError
from gefen_titan.recipe.fault_tolerance import replica_groups

__all__ = ["check_global_order_batch", "check_optimizer", "validate_mesh"]


def validate_mesh(config: Any, path: str, world_size: int | None = None) -> None:
    """Degrees must multiply to the world size (``dp_shard = -1`` fills in),
    and the expert-parallel degree must split the ranks it borrows and the experts.

    Mirrors ``ParallelDims._validate`` but runs before any process group work
    and names the recipe keys instead of asserting.
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    p = config.parallelism
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    for key, degree in degrees.items():
        if degree < 1:
            raise RecipeError(f"{path}: [parallelism] {key} must be >= 1, got {degree}")
    others = 1
    for degree in degrees.values():
        others *= degree
    shard = p.data_parallel_shard_degree
    listing = " * ".join(f"{k}({v})" for k, v in degrees.items())
    if shard == -1:
        if world_size % others:
            raise RecipeError(
                f"{path}: [parallelism] impossible mesh: {listing} = {others} does not "
                f"divide the world size {world_size}; data_parallel_shard_degree = -1 "
                "cannot fill the rest. Change the degrees or the number of processes."
            )
        _check_expert_parallel(config, path, world_size // others)
        return
    if shard < 1:
        raise RecipeError(f"{path}: [parallelism] data_parallel_shard_degree must be -1 or >= 1, got {shard}")
    if shard * others != world_size:
        raise RecipeError(
            f"{path}: [parallelism] impossible mesh: data_parallel_shard_degree({shard}) * "
            f"{listing} = {shard * others}, but the world size is {world_size}. Set "
            "data_parallel_shard_degree = -1 to use all ranks, or launch "
            f"{shard * others} processes."
        )
    _check_expert_parallel(config, path, shard)


def _check_expert_parallel(config: Any, path: str, shard: int) -> None:
    """``expert_parallel_degree``: what torchtitan 0.3.0 fails on late or obscurely.

    EP borrows its ranks from dp_shard * cp * tp (the experts' FSDP, "efsdp",
    runs over the rest); a degree that does not divide them fails in the mesh
    build with ``ValueError: The product of mesh_sizes=(1, 1, 0, 4) is 0 ...``.
    Every EP rank holds the same number of whole experts; experts that do not
    split evenly build, then crash the first forward on every rank
    (``RuntimeError: shape '[3, -1]' is invalid for input of size 8``). A model
    without MoE layers ignores the degree: a flag with no effect.
    """
    p = config.parallelism
    ep = p.expert_parallel_degree
    if ep < 1:
        raise RecipeError(f"{path}: [parallelism] expert_parallel_degree must be >= 1, got {ep}")
    if ep == 1:
        return
    borrowed = shard * p.context_parallel_degree * p.tensor_parallel_degree
    if borrowed % ep:
        raise RecipeError(
            f"{path}: [parallelism] expert_parallel_degree ({ep}) must divide data_parallel_shard_degree({shard}) * "
            f"context_parallel_degree({p.context_parallel_degree}) * tensor_parallel_degree"
            f"({p.tensor_parallel_degree}) = {borrowed}: expert parallelism borrows its ranks from those (the "
            "experts' FSDP runs over the rest). Use a degree that divides it, or more processes.")
    # Not at the top: torchtitan's model code takes seconds to import (loaded by now: the recipe built a model).
    from torchtitan.models.common.moe import MoE  # noqa: PLC0415

    spec = config.model_spec
    if spec is None:  # no model to check against (torchtitan's own check runs at build)
        return
    experts = sorted({cfg.num_experts for _, cfg, _, _ in spec.model.traverse(MoE.Config)})
    if not experts:
        raise RecipeError(
            f"{path}: [parallelism] expert_parallel_degree = {ep}, but {spec.name} {spec.flavor} has no "
            "mixture-of-experts layers: the degree would have no effect. Set it to 1.")
    if uneven := [e for e in experts if e % ep]:
        raise RecipeError(
            f"{path}: [parallelism] expert_parallel_degree ({ep}) does not divide the {uneven[0]} experts of "
            f"{spec.name} {spec.flavor}'s MoE layers: every EP rank holds the same number of whole experts. Use "
            f"a degree that divides {uneven[0]}.")


def check_global_order_batch(config: Any, path: str, world_size: int | None) -> None:
    """A recipe whose loader is DP-invariant (``data.registry.is_dp_invariant``:
    the global-order loader) must fix the global batch, divisible at this DP size.

    The loader's batches are the same samples at every DP size only if a step
    is the same number of samples at every DP size (the trainer otherwise
    makes it local_batch_size x dp degree). torchtitan also asserts the
    divisibility, but only once the process group exists.
    """
    if not is_dp_invariant(config.dataloader):
        return
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    p, t = config.parallelism, config.training
    shard = p.data_parallel_shard_degree
    if shard == -1:
        others = (p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
                  * p.pipeline_parallel_degree)
        shard = world_size // others
    # Under fault tolerance every replica group is one more slice of the same global batch.
    dp = p.data_parallel_replicate_degree * shard * replica_groups(config)
    local, gbs = t.local_batch_size, t.global_batch_size
    if gbs <= 0:
        raise RecipeError(
            f"{path}: [training] global_batch_size: [dataloader] loader = {dp_invariant_names()} needs a fixed "
            "global batch (samples per optimizer step), so that a resume at another data-parallel size "
            f"reads the same batches; set it, e.g. global_batch_size = {local * dp} (local_batch_size "
            f"{local} x dp degree {dp}; a multiple of it for gradient accumulation)"
        )
    if gbs % (local * dp):
        fits = [b for b in range(1, gbs // dp + 1) if gbs % (b * dp) == 0] if gbs % dp == 0 else []
        hint = (f"local_batch_size values that fit: {', '.join(map(str, fits))}" if fits
                else f"no local_batch_size fits: make global_batch_size a multiple of {dp}")
        raise RecipeError(
            f"{path}: [training] global_batch_size {gbs} is not a multiple of local_batch_size {local} x "
            f"data-parallel degree {dp} = {local * dp}: the global batch cannot be cut into equal rank "
            f"slices at this size ({hint})"
        )


def check_optimizer(opt: GefenOptimizersContainer.Config, path: str, set_by: dict[str, str]) -> None:
    """No [optimizer] key set without effect, no group key its optimizer ignores.

    ``set_by`` says where the recipe or the command line set the
    ``GROUP_DEFAULTS`` (``Recipe.set_by``): only those are reported, at the
    place they were set, not a value lifted from the base config function.
    """
    try:
        param_groups.check_param_groups(opt)
    except ValueError as e:
        raise RecipeError(f"{path}: [optimizer] {e}") from None
    for key in param_groups.unused_defaults(opt):
        where = set_by.get(f"optimizer.{key}")
        if where is None:  # the base config's, not the recipe's: nothing the recipe can drop
            continue
        group_key = "optimizer_name" if key == "name" else f"optimizer_kwargs.{key}"
        raise RecipeError(
            f"{where}: has no effect: every [[optimizer.param_groups]] sets its own {group_key}. "
            f"[optimizer] {key}, once set, stands for the groups that leave it out: leave it out of the "
            f"groups that should use it, or do not set [optimizer] {key}"
        )
