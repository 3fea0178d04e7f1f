"""A recipe's model and optimizer built on the meta device, as the Trainer builds them.

No GPU, no data, no real process group: torchtitan's fake process group at
the recipe's world size, its ``ParallelDims`` and ``parallelize_fn``, then the
optimizer container. The scale plan (``benchmarks/scale.py``) sizes 8B-405B
jobs from it, and ``tests/integration/test_recipe_regression.py`` checks that
the GPU recipes build as shipped. It replaces any process group of the
process: run it in a process of its own, never inside a job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan.config.override import apply_overrides
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils

from gefen_titan.recipe.build import load_recipe

__all__ = ["MetaBuild", "build_on_meta", "fake_process_group"]


@dataclass
class MetaBuild:
    config: Any  # the recipe's Trainer.Config
    model: torch.nn.Module  # parallelized, on the meta device
    optimizers: Any  # GefenOptimizersContainer
    numel: int  # parameters of the model before parallelization


def fake_process_group(world: int) -> None:
    """torchtitan's fake process group at ``world`` ranks (this process is rank 0)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())


def build_on_meta(recipe: str, world_size: int, overrides: dict[str, Any] | None = None) -> MetaBuild:
    """The Trainer's build steps up to the optimizer for ``recipe`` at ``world_size`` ranks."""
    config = load_recipe(recipe, overrides or {}, world_size=world_size).config
    fake_process_group(world_size)
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    if config.override.imports:
        apply_overrides(config.override, config)
    with torch.device("meta"):
        model = model_config.build()
    numel = sum(p.numel() for p in model.parameters())
    model = config.model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder="/nonexistent",
    )
    return MetaBuild(config, model, config.optimizer.build(model_parts=[model]), numel)
