"""``--training.enable_cpu_offload`` end to end on a CPU host, through ``train.py``.

FSDP2's ``CPUOffloadPolicy`` keeps the shards, gradients and optimizer state
in host memory and steps there (``patches.cpu_offload`` lets torchtitan start
it on CPU hosts; ``optim.cpu_step`` is the step's kernel). On a CPU host it
changes no arithmetic, so:

* ``recipes/llama_gefen.toml`` with the flag at 2 ranks trains the stored
  curve of the recipe without it (``tests/reference_curves``), saves at step
  2, and that checkpoint resumes at 1 rank *without* offload with every
  parameter and optimizer entry, period, codebook and counter equal to the
  save's (``compare_global_state``, the reshard validation's check); step 3
  trains. The log names the kernel as the path of every Gefen optimizer.
* ``recipes/llama_gefen_muon_hybrid.toml`` (GefenMuon and Gefen groups) with
  the flag trains the stored curve's first 2 steps, both optimizers on the
  kernel.

The reshard matrix of offloaded checkpoints (offloaded <-> not, other DP
sizes, Gefen and GefenMuon) is test_agreed_blocking.py's and
test_gefen_muon.py's (their ``fsdp_offload`` layout). Forked ranks
(``processes.run_ranks``): three launches without torchrun's imports.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from gefen_titan.train import main
from gefen_titan.validation import runs
from gefen_titan.validation.compare_global import compare_global_state
from tests.helpers import processes
from tests.helpers import reference_curves as urc

ROOT = Path(__file__).resolve().parents[2]
OFFLOAD = "--training.enable_cpu_offload"
S = 2  # the checkpoint step; one step after it


def stored(recipe: str) -> dict:
    return json.loads(urc.curve_path(ROOT / recipe).read_text())


def argv(recipe: str, folder: Path, nproc: int, steps: int, *extra: str, dump: Path | None = None) -> list[str]:
    curve = stored(recipe)["settings"]
    settings = runs.Settings(recipe=recipe, steps_before=S, steps_after=steps - S,
                             global_batch=curve["global_batch"], local_batch=curve["local_batch"])
    imports = runs.recipe_imports(recipe)
    if dump is not None:
        imports = imports + [[runs.HOOK, {"dir": str(dump), "save_steps": [S]}]]
    return ["--job.config", recipe, "--job.dump_folder", str(folder), *settings.overrides(nproc), *extra,
            *runs.imports_flag(imports)]


def train(nproc: int, args: list[str], logs: Path) -> str:
    return processes.run_ranks(nproc, main, args, logs=logs, timeout=800)


def assert_stored_losses(recipe: str, log: str, steps: int) -> dict[int, float]:
    losses = runs.parse_losses(log)
    assert sorted(losses) == list(range(1, steps + 1)), losses
    curve = stored(recipe)
    first = {**curve, "losses": {k: v for k, v in curve["losses"].items() if int(k) <= steps}}
    deviation, problems = urc.compare(first, losses)
    assert not problems, problems
    return losses


@pytest.fixture(scope="module")
def gefen(tmp_path_factory):
    base = tmp_path_factory.mktemp("cpu_offload")
    recipe = "recipes/llama_gefen.toml"
    ref_log = train(2, argv(recipe, base / "ref", 2, S + 1, OFFLOAD, dump=base / "ref_dump"), base / "logs_ref")
    resume = base / "resume"
    shutil.copytree(base / "ref" / "checkpoint" / f"step-{S}", resume / "checkpoint" / f"step-{S}")
    res_log = train(1, argv(recipe, resume, 1, S + 1, "--checkpoint.load_step", str(S), dump=base / "res_dump"),
                    base / "logs_res")
    return recipe, base, ref_log, res_log


def test_offloaded_gefen_trains_the_recipes_curve_on_the_kernel(gefen):
    recipe, _, ref_log, _ = gefen
    assert_stored_losses(recipe, ref_log, S + 1)
    assert ref_log.count("Gefen (cpu parameters): the exact CPU kernel for its step") == 2  # each rank


def test_offloaded_checkpoint_resumes_at_1_rank_without_offload_bit_exact(gefen):
    _, base, _, res_log = gefen
    saved_dumps = sorted((base / "ref_dump").glob(f"save-{S}-*rank*.pt"))
    loaded_dumps = sorted((base / "res_dump").glob(f"load-{S}-*rank*.pt"))
    assert saved_dumps and loaded_dumps
    result = compare_global_state([torch.load(f, weights_only=True) for f in saved_dumps],
                                  [torch.load(f, weights_only=True) for f in loaded_dumps])
    assert result["exact"] and result["params_exact"] and result["entries_differ"] == [], result["problems"]
    losses = runs.parse_losses(res_log)
    assert sorted(losses) == [S + 1] and math.isfinite(losses[S + 1])
    assert f"Loading step {S} from " in res_log  # the manager's load line


def test_offloaded_hybrid_trains_gefen_muon_and_gefen_on_the_kernel(tmp_path):
    recipe = "recipes/llama_gefen_muon_hybrid.toml"
    log = train(2, argv(recipe, tmp_path / "run", 2, 2, OFFLOAD, "--checkpoint.enable", "false"), tmp_path / "logs")
    assert_stored_losses(recipe, log, 2)
    assert log.count("GefenMuon (cpu parameters): the exact CPU kernel for its momentum") == 2
    assert log.count("Gefen (cpu parameters): the exact CPU kernel for its step") == 2
