"""Mixture-of-experts: torchtitan's load-balancing state survives a resume (docs/moe.md).

What torchtitan 0.3.0 keeps of it, and so what a resume must give back:
each MoE layer's ``expert_bias_E`` is a persistent buffer, so it is in the
model's state dict and in every checkpoint (a model-only one too);
``tokens_per_expert_E`` is not persistent: the step pre-hook that moves the
bias zeroes it, so it is zero at every save and a resume loses nothing by
starting it at zero. The test trains the DeepSeek-V3 recipe's CI reference
(2 ranks, save at step 4, model-only save at step 7: the run of
test_recipe_regression.py, shared through the session's reference cache),
resumes its step-4 checkpoint at the same layout for the 3 remaining steps,
and reads the biases from the checkpoints: the resumed run's step-7 bias
must be the uninterrupted run's bit for bit, which it is only if the load
gave back the step-4 bias exactly (a bias lost, zeroed or perturbed at the
load moves every later update: they are signs of its routing) and the
hook ran once per resumed step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gefen_titan.ckpt_tools.view import Checkpoint
from gefen_titan.validation import runs
from tests.helpers import reference_curves as urc

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "dsv3_gefen.toml"


def _biases(run_folder: str, step: int) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(str(Path(run_folder, "checkpoint", f"step-{step}")))
    keys = sorted(k for k in ckpt.entries if k.endswith(".moe.expert_bias_E"))
    return ckpt.load(keys)


def test_expert_bias_survives_a_resume_bit_for_bit(reference_cache, tmp_path):
    stored = json.loads(urc.curve_path(RECIPE).read_text())
    settings = urc.settings_for(RECIPE, stored)
    ref = runs.reference_run(settings, stored["nproc"], out=tmp_path, cache=reference_cache, quiet=True)
    resumed = runs.resume_run(settings, ref, stored["nproc"], tmp_path / "resume")

    saved, ref_end, resumed_end = _biases(ref.folder, 4), _biases(ref.folder, 7), _biases(resumed.folder, 7)
    assert list(saved) == [f"layers.{i}.moe.expert_bias_E" for i in (1, 2, 3)]  # layer 0 is dense
    assert all(torch.count_nonzero(b) for b in saved.values()), "the bias never moved: nothing to lose"
    assert all(not torch.equal(saved[k], ref_end[k]) for k in saved), "the bias stopped moving after step 4"
    for key in saved:
        assert torch.equal(resumed_end[key], ref_end[key]), (
            f"{key} at step 7: resumed {resumed_end[key].tolist()} != uninterrupted {ref_end[key].tolist()}")
    # And the steps themselves: a same-layout resume of this recipe is the uninterrupted run.
    assert {s: resumed.losses[s] for s in (5, 6, 7)} == {s: ref.losses[s] for s in (5, 6, 7)}
