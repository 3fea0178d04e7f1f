"""Meshes beyond FSDP, for real on CPU ranks (gloo): FSDP2 x TP and pipeline
parallelism train the debug model with Gefen and save format-v2
checkpoints, and the pieces that make them work (the SDPA override's
local_map, FSDP2 x TP random init) are checked against single-device results.

* ``recipes/llama_gefen_fsdp_tp.toml`` at 4 ranks (FSDP 2 x TP 2): trains, the
  loss falls, its step-4 checkpoint is written, and step 1 equals the FSDP 2
  run of ``recipes/llama_gefen_dp2.toml`` at 2 ranks on the same data (same
  init, same forward);
* ``recipes/llama_gefen_pp2.toml`` at 2 ranks (PP 2, 1F1B): trains, the last
  stage's loss falls, its step-4 checkpoint is written;
* 2 gloo ranks (one launch): the SDPA override on a TP
  mesh (head-sharded DTensors through torchtitan's local_map) against plain
  SDPA on the full tensors (forward equal, input grads within 1e-6); and
  ``cpu_dtensor_rng`` with FSDP2's ``_StridedShard`` placements equals one
  draw of the full tensor.

The three trainings are the recipes' CI runs (``tests.helpers.reference_curves``:
7 steps, a checkpoint at step 4), taken from the session's reference cache
(``reference_cache`` in tests/conftest.py): the recipe regression and the
reshard validation train the same runs, so a session trains each once.
Whether a checkpoint resumes bit-exactly under other layouts is
tests/integration/test_agreed_blocking.py's (TP included) and the
validation's.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gefen_titan.patches as P
from gefen_titan.validation import runs as vr
from tests.helpers import processes
from tests.helpers import reference_curves as urc

ROOT = Path(__file__).resolve().parents[2]
PKG = P.__name__


def ci_run(recipe: str, reference_cache: Path) -> tuple[vr.Run, str]:
    """(run, its log) of ``recipe``'s CI run, trained or reused from the cache."""
    path = ROOT / "recipes" / recipe
    # The stored curve's settings and process count: the same run identity
    # as the recipe regression's, so that one run serves both.
    stored = json.loads(urc.curve_path(path).read_text())
    _, nproc, run = urc.run_recipe(path, out=reference_cache.parent / "meshes_cpu", cache=reference_cache,
                                   stored=stored)
    assert nproc == stored["nproc"]
    return run, re.sub(r"\x1b\[[0-9;]*m", "", (Path(run.folder) / "train.log").read_text())


def _trained(run: vr.Run) -> None:
    steps = vr.CI_SETTINGS["steps_before"] + vr.CI_SETTINGS["steps_after"]
    assert sorted(run.losses) == list(range(1, steps + 1)), run.losses
    assert run.losses[steps] < run.losses[1] - 0.4, run.losses
    # The checkpoint at steps_before, under the run's own layout.
    step_dir = Path(run.folder) / "checkpoint" / f"step-{vr.CI_SETTINGS['steps_before']}"
    assert (step_dir / ".metadata").exists(), sorted(Path(run.folder, "checkpoint").iterdir())


# ------------------------------------------------------------ torchrun runs


def test_fsdp2_x_tp2_trains_and_matches_fsdp2_at_step_1(reference_cache):
    run, log = ci_run("llama_gefen_fsdp_tp.toml", reference_cache)
    assert run.nproc == 4 and "dp_shard=2, cp=1, tp=2" in log
    _trained(run)
    # Same data (2 data-parallel shards), same init: TP must not change step 1.
    ref, _ = ci_run("llama_gefen_dp2.toml", reference_cache)
    assert ref.nproc == 2
    assert abs(run.losses[1] - ref.losses[1]) < 1e-4, (run.losses[1], ref.losses[1])


def test_pipeline_parallel_2_stages_trains(reference_cache):
    run, log = ci_run("llama_gefen_pp2.toml", reference_cache)
    # local batch 2 of the CI settings, microbatch 1 (the recipe's)
    assert run.nproc == 2 and "Using pipeline schedule 1F1B with 2 microbatches" in log
    _trained(run)


# ------------------------------- 2 gloo ranks: SDPA local_map, strided init


def _sdpa_check(rank: int, world_size: int) -> None:
    """The SDPA override on a TP mesh (head-sharded DTensors through
    torchtitan's local_map) against plain SDPA on the full tensors."""
    import importlib

    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    importlib.import_module(f"{PKG}.sdpa_attention")
    # The trainer's order: update_from_config sets the sharding configs, then
    # overrides run.
    cfg = llama3_debugmodel()
    cfg.parallelism.tensor_parallel_degree = world_size
    cfg.parallelism.data_parallel_shard_degree = 1
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.model_spec.model.update_from_config(config=cfg)
    apply_overrides(OverrideConfig(imports=[f"{PKG}.sdpa_attention.sdpa_attention"]), cfg)
    inner = cfg.model_spec.model.layers[0].attention.inner_attention
    assert type(inner) is ScaledDotProductAttention.Config
    assert inner.sharding_config is not None and inner.sharding_config.local_map is not None

    dist_utils.set_spmd_backend("partial_dtensor")
    pdims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1,
                         world_size=world_size, spmd_backend="partial_dtensor")
    pdims.build_mesh()
    tp = pdims.get_mesh("tp")
    attn = inner.build()
    attn.parallelize(pdims)

    # (B, L, N, H), identical on every rank; heads are what TP shards.
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 24, 8, 16, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = ScaledDotProductAttention.Config().build()(*leaves)
    (ref * g).sum().backward()

    dts = [distribute_tensor(t, tp, [Shard(2)]).requires_grad_() for t in (q, k, v)]
    out = attn(*dts)
    assert isinstance(out, DTensor) and tuple(out.placements) == (Shard(2),), out
    assert out.to_local().shape == (2, 24, 8 // world_size, 16)
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=0, atol=0)
    (out * distribute_tensor(g, tp, [Shard(2)])).sum().backward()
    for name, d, t in zip("qkv", dts, leaves):
        assert tuple(d.grad.placements) == (Shard(2),), (name, d.grad.placements)
        full = d.grad.full_tensor()  # a collective: every rank, same order
        torch.testing.assert_close(full, t.grad, rtol=0, atol=1e-6, msg=f"grad {name}")


def _strided_rng_check(rank: int, world_size: int) -> None:
    """cpu_dtensor_rng with FSDP2 x TP's ``_StridedShard``: on a 1-D mesh a
    rank's shard is two separate row blocks; on the (fsdp 1, tp 2) mesh of a
    pure TP run it is what FSDP2 gives wqkv/w1/w3/embeddings."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    flat = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    grid = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("fsdp", "tp"))
    cases = [
        (flat, (16, 6), (_StridedShard(0, split_factor=2),)),
        (flat, (15, 6), (_StridedShard(0, split_factor=2),)),
        (grid, (16, 6), (_StridedShard(0, split_factor=2), Shard(0))),
        (grid, (16, 6), (Shard(0), Shard(1))),
        (grid, (7,), (Shard(0), Replicate())),
    ]
    for mesh, shape, placements in cases:
        for init in (lambda t: nn.init.trunc_normal_(t, std=0.02), nn.init.normal_):
            torch.manual_seed(1234)
            d = distribute_tensor(torch.zeros(shape), mesh, list(placements), src_data_rank=None)
            init(d)
            torch.manual_seed(1234)
            ref = init(torch.zeros(shape))
            assert torch.equal(d.full_tensor(), ref), (shape, placements)


def _two_rank_worker(argv: list[str]) -> None:
    """Both checks on this rank (``processes.run_ranks``), a marker file in ``argv[0]`` for each passed."""
    (out_dir,) = argv
    P.apply_all()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        for check in (_sdpa_check, _strided_rng_check):
            check(rank, world_size)
            open(os.path.join(out_dir, f"{check.__name__}.ok{rank}"), "w").close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_checks(tmp_path_factory):
    """One 2-rank launch for both checks."""
    out = tmp_path_factory.mktemp("two_rank")
    try:
        processes.run_ranks(2, _two_rank_worker, [str(out)], logs=out / "logs", timeout=600)
    except Exception as e:  # reported by the tests below, each naming its check
        return out, e
    return out, None


def _assert_check_passed(two_rank_checks, name):
    out, error = two_rank_checks
    assert all((out / f"{name}.ok{r}").exists() for r in range(2)), error


def test_sdpa_local_map_on_2_rank_tp_mesh_matches_plain_sdpa(two_rank_checks):
    _assert_check_passed(two_rank_checks, "_sdpa_check")


def test_cpu_dtensor_rng_with_strided_shards_equals_single_draw(two_rank_checks):
    _assert_check_passed(two_rank_checks, "_strided_rng_check")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
