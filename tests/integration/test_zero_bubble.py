"""Zero-bubble pipeline schedules end to end at PP 2 on 2 CPU ranks, through ``train.py``.

``ZBVZeroBubble`` splits each stage's backward into an input step and a later
weight step; without the ``pp_split_backward_unshard`` patch the final
``norm.weight`` gets no gradient, and agreed blocking stops at step 1
(``BlockingError``; the unit contract test is
``tests/unit/test_patches.py::test_zero_bubble_schedules_compute_every_gradient``).
Here the debug model (4 stages, two per rank in a V) trains with Gefen's agreed
blocking on the global-order loader (the same global batches at every layout),
saves at step S, and that checkpoint resumes

* under ``ZBVZeroBubble`` again: the state right after the load equals the
  save's bit for bit (``compare_global_state``, the reshard validation's
  check), and the K steps after it equal the uninterrupted run's: every
  parameter at step S+K, and the losses;
* under ``1F1B`` (2 stages, one per rank) and under FSDP 2: the state right
  after the load equals the save's bit for bit: every parameter and every
  per-parameter entry, and the entries each stage's optimizer writes under
  its first parameter's name (its record and codebook: other stages, other
  names) by what they hold, each parameter's record and the job's one
  codebook; and step S+1's loss (the same parameters on the same global
  batch) and step S+2's equal the uninterrupted run's up to the reduction
  order.
  Parameters K steps later cannot be compared with an uninterrupted run at
  those layouts: torchtitan seeds each pipeline rank's stages, so every
  pipeline layout starts from another init.

Forked ranks (``processes.run_ranks``): four launches without torchrun's imports.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gefen_titan.train import main
from gefen_titan.validation import params, runs
from gefen_titan.validation.compare_global import compare_global_state
from gefen_titan.validation.dumps import merge_global
from gefen_titan.validation.layouts import parse_side
from tests.helpers import processes

RECIPE = "recipes/llama_gefen_global_order.toml"
S, K = 2, 2
# Global batch 8 of local batch 4: at PP 2 (one data shard) 2 accumulation
# steps of 4 microbatches of one sequence, one per stage (fewer leave a bubble).
BATCH = {"global_batch": 8, "local_batch": 4}
SCHEDULE = "--parallelism.pipeline_parallel_schedule"
MICROBATCH = ["--parallelism.pipeline_parallel_microbatch_size", "1"]
# The entries a stage's optimizer writes under its first parameter's name.
PER_STAGE = ("gefen/optimizer/", "gefen/codebook/")
# Same parameters, same batches, another layout: the losses after the load
# within the reduction order (measured on 2026-12-06: step S+1 equal to the
# log's 5 decimals under 1F1B and FSDP 2, step S+2 equal and 1e-5 apart).
LOSS_ORDER = 5e-5


def train(base: Path, name: str, side: str, schedule: str | None, *, load: bool) -> str:
    """One launch at ``side``; a resume copies the ZBV run's step-S checkpoint first."""
    folder = base / name
    extra = [SCHEDULE, schedule, *MICROBATCH] if schedule else []
    if load:
        shutil.copytree(base / "zbv" / "checkpoint" / f"step-{S}", folder / "checkpoint" / f"step-{S}")
        extra += ["--checkpoint.load_step", str(S)]
    settings = runs.Settings(recipe=RECIPE, steps_before=S, steps_after=K, **BATCH)
    hook = [runs.HOOK, {"dir": str(base / f"{name}_dump"), "save_steps": [S]}]
    argv = ["--job.config", RECIPE, "--job.dump_folder", str(folder), *settings.overrides(parse_side(side)),
            *extra, *runs.imports_flag(runs.recipe_imports(RECIPE) + [hook])]
    return processes.run_ranks(2, main, argv, logs=base / f"logs_{name}", timeout=800)


def dumps(base: Path, name: str, kind: str) -> list[dict]:
    files = sorted((base / f"{name}_dump").glob(f"{kind}-{S}-*rank*.pt"))
    assert files, f"no {kind} dumps in {base / f'{name}_dump'}"
    return [torch.load(f, weights_only=True) for f in files]


@pytest.fixture(scope="module")
def zbv(tmp_path_factory):
    base = tmp_path_factory.mktemp("zero_bubble")
    logs = {"zbv": train(base, "zbv", "2@pp2", "ZBVZeroBubble", load=False)}
    for name, side, schedule in (("to_zbv", "2@pp2", "ZBVZeroBubble"), ("to_1f1b", "2@pp2", "1F1B"),
                                 ("to_fsdp2", "2", None)):
        logs[name] = train(base, name, side, schedule, load=True)
    return base, logs


def test_zbv_trains_with_agreed_blocking(zbv):
    _, logs = zbv
    assert "Using pipeline schedule ZBVZeroBubble with 4 microbatches and 4 stages" in logs["zbv"]
    losses = runs.parse_losses(logs["zbv"])
    assert sorted(losses) == list(range(1, S + K + 1)), losses
    assert losses[S + K] < losses[1]


def param_records(state: dict) -> dict[str, dict]:
    return {rec["fqn"]: rec for key, value in state.items() if key.startswith("gefen/optimizer/")
            for rec in json.loads(value)["params"]}


def optimizer_frames(state: dict) -> list[dict]:
    """Each stage optimizer's record without its parameters (step, blocking, ...)."""
    return [{k: v for k, v in json.loads(value).items() if k != "params"}
            for key, value in state.items() if key.startswith("gefen/optimizer/")]


def codebook(state: dict) -> torch.Tensor:
    """The job's one codebook: every stage's copy must be it."""
    books = [v for k, v in state.items() if k.startswith("gefen/codebook/")]
    assert books and all(torch.equal(books[0], b) for b in books[1:])
    return books[0]


def test_zbv_checkpoint_loads_bit_exact_under_zbv(zbv):
    base, logs = zbv
    result = compare_global_state(dumps(base, "zbv", "save"), dumps(base, "to_zbv", "load"))
    assert result["exact"] and result["params_exact"] and result["entries_differ"] == [], result["problems"]
    assert "Loading step " in logs["to_zbv"]  # the manager's load line


@pytest.mark.parametrize("name", ["to_1f1b", "to_fsdp2"])
def test_zbv_checkpoint_loads_bit_exact_at_another_layout(zbv, name):
    base, logs = zbv
    saved, loaded = merge_global(dumps(base, "zbv", "save")), merge_global(dumps(base, name, "load"))
    assert saved["complete"] and loaded["complete"]
    assert saved["params"].keys() == loaded["params"].keys()
    assert [n for n, p in saved["params"].items() if not torch.equal(p, loaded["params"][n])] == []
    a, b = saved["state"], loaded["state"]
    shared = sorted(k for k in set(a) | set(b) if not k.startswith(PER_STAGE))
    assert len(shared) > 50
    differ = [k for k in shared if k not in a or k not in b or type(a[k]) is not type(b[k])
              or not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    assert differ == []
    assert param_records(a) == param_records(b) and len(param_records(a)) == len(saved["params"])
    frames = optimizer_frames(a) + optimizer_frames(b)
    assert all(f == frames[0] for f in frames), frames
    assert torch.equal(codebook(a), codebook(b))
    assert "Loading step " in logs[name]  # the manager's load line


def test_zbv_resume_continues_the_uninterrupted_run_bit_exact(zbv):
    base, logs = zbv
    ref, res = runs.parse_losses(logs["zbv"]), runs.parse_losses(logs["to_zbv"])
    assert sorted(res) == list(range(S + 1, S + K + 1)) and all(res[s] == ref[s] for s in res), (ref, res)
    final = f"step-{S + K}"
    dev = params.param_deviation(base / "to_zbv" / "checkpoint" / final, base / "zbv" / "checkpoint" / final)
    assert dev["exact"] and dev["entries"] > 0, dev


@pytest.mark.parametrize("name", ["to_1f1b", "to_fsdp2"])
def test_zbv_checkpoint_gives_the_same_loss_at_another_layout(zbv, name):
    _, logs = zbv
    ref, res = runs.parse_losses(logs["zbv"]), runs.parse_losses(logs[name])
    assert sorted(res) == list(range(S + 1, S + K + 1)), res
    assert all(abs(res[s] - ref[s]) <= LOSS_ORDER for s in res), (ref, res)
