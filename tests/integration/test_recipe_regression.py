"""Recipe regression: every shipped recipe keeps working.

* CPU recipes (``recipes/llama_gefen*.toml`` and the mixture-of-experts
  ``dsv3_gefen*.toml``, ``qwen3_moe_gefen*.toml``: ``CPU_GLOBS``): trained for 7 steps on gloo at
  their own number of processes with the CI settings and compared, step by
  step, with the curve stored in ``tests/reference_curves/<recipe>.json``
  within ``TOLERANCE`` of ``tests/helpers/reference_curves.py``. The runs are
  pinned to torch's AVX2 CPU kernels (``ATEN_CPU_CAPABILITY=avx2``), which
  every x86 CI host runs, and are deterministic there: torch's AVX-512
  kernels round otherwise, and the MoE routing amplifies that past the
  tolerance (docs/validation.md). Each file records the kernels it was made
  under, and a run is compared only with a curve of the same kernels
  (``scripts/update_reference_curves.py`` regenerates the curves when a
  change is meant to change training). The
  files repeat the tolerance for their readers; it must equal the constant,
  so that editing a file cannot loosen the check. Recipes that resolve to the same run
  (``llama_gefen`` at 2 processes and ``llama_gefen_dp2``) share it, and so do
  the reference runs of tests/integration/test_validate_reshard.py (session cache).
* GPU-only recipes (``llama3_8b_gefen.toml``): parsed and built without a GPU,
  in a subprocess: torchtitan's fake process group at the recipe's world size
  (8), the model on the meta device, torchtitan's parallelize (FSDP2), the
  optimizer container and LR schedulers, as the Trainer does. The tokenizer
  and data set are not there, so the data loader is not built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import processes, suite_cache
from tests.helpers import reference_curves as urc

ROOT = Path(__file__).resolve().parents[2]

CPU_RECIPES = urc.cpu_recipes()
GPU_RECIPES = {"llama3_8b_gefen.toml": 8}  # recipe -> world size it is built for


def test_every_shipped_recipe_is_covered():
    shipped = {p.name for p in (ROOT / "recipes").glob("*.toml")}
    ft = urc.ft_recipes()
    assert shipped == {p.name for p in CPU_RECIPES} | {p.name for p in ft} | set(GPU_RECIPES)
    # The torchft recipes run in the fault-tolerance test, each against its own uninterrupted run.
    ft_test = (ROOT / "tests" / "integration" / "test_fault_tolerance.py").read_text()
    assert ft and all(f"recipes/{p.name}" in ft_test for p in ft)
    for recipe in CPU_RECIPES:
        assert urc.curve_path(recipe).exists(), \
            f"no stored curve for {recipe.name}: run scripts/update_reference_curves.py"


def test_stored_tolerance_is_the_code_constant():
    for recipe in CPU_RECIPES:
        stored = json.loads(urc.curve_path(recipe).read_text())
        assert stored["tolerance"] == urc.TOLERANCE, \
            f"{recipe.stem}: stored tolerance {stored['tolerance']} != TOLERANCE {urc.TOLERANCE}"


def test_stored_curves_record_the_pinned_cpu_kernels():
    """Every stored curve was made under the pinned kernels (torch names ATEN_CPU_CAPABILITY=avx2 "AVX2"), and
    a run under other kernels is not compared with it: it is named, as this host's missing curve."""
    assert urc.PINNED_CPU_KERNELS == "avx2"
    for recipe in [*CPU_RECIPES, *urc.ft_recipes()]:
        assert json.loads(urc.curve_path(recipe).read_text())["cpu_kernels"] == "AVX2", recipe.name
    stored = {"losses": {"1": 8.0}, "tolerance": urc.TOLERANCE, "cpu_kernels": "AVX2"}
    assert urc.kernels_problem(stored, "AVX2") is None
    assert "made under torch's AVX2 CPU kernels and this host's torch runs DEFAULT" in urc.kernels_problem(
        stored, "DEFAULT")
    assert "does not record" in urc.kernels_problem({"losses": {}}, "AVX2")


def test_compare_flags_a_curve_off_by_more_than_the_tolerance():
    assert urc.TOLERANCE == 2e-4
    stored = {"losses": {"1": 8.0, "2": 7.5}, "tolerance": urc.TOLERANCE}
    assert urc.compare(stored, {1: 8.0, 2: 7.5001})[1] == []
    dev, problems = urc.compare(stored, {1: 8.0, 2: 7.5005})
    assert dev == pytest.approx(5e-4) and "step 2: 7.50050 vs stored 7.50000" in problems[0]
    assert urc.compare(stored, {1: 8.0})[1]  # a missing step is a failure
    # The file's own value is not what is compared with: a loosened file still fails.
    assert urc.compare({**stored, "tolerance": 1.0}, {1: 8.0, 2: 7.5005})[1] == problems


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recipe_regression")


@pytest.mark.parametrize("recipe", CPU_RECIPES, ids=lambda p: p.stem)
def test_cpu_recipe_matches_stored_curve(recipe, runs_dir, tmp_path_factory):
    stored = json.loads(urc.curve_path(recipe).read_text())
    assert stored["recipe"] == f"recipes/{recipe.name}" and stored["tolerance"] == urc.TOLERANCE
    if why := urc.kernels_problem(stored, urc.pinned_cpu_kernels()):
        pytest.skip(why)  # a host (an ARM one) whose torch cannot run the kernels the curves were made under
    cache = suite_cache.reference_cache(tmp_path_factory)
    settings, nproc, run = urc.run_recipe(recipe, out=runs_dir, cache=cache, stored=stored)
    assert nproc == stored["nproc"] and settings.torch_cpu_kernels() == stored["cpu_kernels"]
    dev, problems = urc.compare(stored, run.losses)
    assert not problems, f"{recipe.name}: {'; '.join(problems)}; new curve {run.losses}"


def test_forked_ranks_train_the_bits_torchrun_trains(runs_dir, tmp_path_factory):
    """The recipe runs here (and the validations' references they share through the cache) fork
    their ranks from one server (``validation.launchers``); the cache does not record the launcher,
    so a forked run must be torchrun's run: the same losses and every dumped tensor of the step-S
    save equal, bit for bit."""
    from gefen_titan.validation import launchers, runs

    if launchers.can_fork() is not None:
        pytest.skip(launchers.can_fork())  # then every run here is torchrun's: nothing to compare
    recipe = ROOT / "recipes" / "llama_gefen.toml"
    stored = json.loads(urc.curve_path(recipe).read_text())
    cache = suite_cache.reference_cache(tmp_path_factory)
    settings, nproc, forked = urc.run_recipe(recipe, out=runs_dir, cache=cache, stored=stored)
    assert settings.launcher == "fork"
    settings.launcher = "torchrun"
    plain = runs.reference_run(settings, nproc, out=tmp_path_factory.mktemp("torchrun_launch"), quiet=True)
    assert plain.losses == forked.losses
    a, b = forked.dumps("save", settings.steps_before), plain.dumps("save", settings.steps_before)
    assert len(a) == len(b) > 0
    for da, db in zip(a, b):
        tensors = {f"{part}/{k}": (v, db[part].get(k)) for part in ("params", "state")
                   for k, v in da[part].items() if isinstance(v, torch.Tensor)}
        assert len(tensors) > 45 and sorted(da["state"]) == sorted(db["state"])
        differ = [k for k, (x, y) in tensors.items() if not isinstance(y, torch.Tensor) or not torch.equal(
            x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8))]
        assert not differ, differ


# ------------------------------------------------------------ GPU recipes
def built_on_meta(recipe: str, world_size: int, overrides: dict) -> dict:
    """What the Trainer builds for ``recipe`` up to the optimizer, on the meta
    device (``benchmarks.meta``; run in a fresh process: it creates a fake
    process group)."""
    from benchmarks.meta import build_on_meta
    from gefen_titan.optim import gefenx as gx

    built = build_on_meta(recipe, world_size, overrides)
    config, optimizers = built.config, built.optimizers
    config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    params = list(built.model.named_parameters())
    return {
        "numel": built.numel,
        "placements": sorted({str(tuple(p.placements)) for _, p in params}),
        "mesh_sizes": sorted({p.device_mesh.size() for _, p in params}),
        "optimizers": [type(o).__name__ for o in optimizers.optimizers],
        "gefen_params": sum(1 for o in optimizers.optimizers_of("Gefen") for _ in gx.named_params(o)),
        "params": len(params),
        "checkpoint": type(config.checkpoint).__qualname__,
    }


def _build(recipe: str, world_size: int, overrides: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.integration.test_recipe_regression", "--build", recipe, str(world_size),
           json.dumps(overrides or {})]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return processes.run(cmd, cwd=ROOT, timeout=600, env=env)


def _check_built(proc, world_size):
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert built["numel"] > 8.0e9  # Llama 3.1 8B
    assert built["placements"] == ["(Shard(dim=0),)"] and built["mesh_sizes"] == [world_size]
    assert built["optimizers"] == ["Gefen"] and built["gefen_params"] == built["params"]
    assert built["checkpoint"] == "GefenCheckpointManager.Config"


@pytest.mark.parametrize("recipe,world_size", GPU_RECIPES.items())
def test_gpu_recipe_builds_as_shipped(recipe, world_size):
    _check_built(_build(f"recipes/{recipe}", world_size), world_size)


if __name__ == "__main__" and sys.argv[1:2] == ["--build"]:
    from gefen_titan import patches

    patches.apply_all()

    print(json.dumps(built_on_meta(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))))
