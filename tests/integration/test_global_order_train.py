"""The global-order recipe for real, through the reshard validation:
``scripts/validate_reshard.py --recipe recipes/llama_gefen_global_order.toml
--pairs 2:1`` on CPU (gloo) with the CI settings (save at step 4, 3 more
steps, global batch 8 of local 2).

What must hold: from the resume on, the 1-rank run reads exactly the global
batches of the uninterrupted 2-rank run (every run records them through the
opt-in ``gefen_titan.validation.hooks.record_batches``), although it runs 4
microbatches a step where the 2-rank run ran 2; the state after the load is
bit-exact (agreed blocking); so its losses are compared with the
uninterrupted run's step by step, with a tolerance measured from a same-size
rerun and from the references at 1 and 2 ranks (which read the same batches
too and differ only by the gradient reduction order), not from a data-order
band. The references are shared with tests/integration/test_recipe_regression.py
(session cache).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gefen_titan.validation import bands, runs
from gefen_titan.validation.report import compare_batches
from tests.helpers import processes, suite_cache

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "validate_reshard.py"
CI = runs.CI_SETTINGS

# The global-order band of this pair: measured 3e-5 (= 3 x the references at
# 1 and 2 ranks differing by 1e-5, one unit of the 5 logged decimals) on
# 2026-12-01 and again on this branch. The cap leaves room for another CPU's
# reduction order: running with OMP_NUM_THREADS=2 moved the recipe curves by
# up to 2e-5 (tests/helpers/reference_curves.py), a band of 6e-5, which is
# also what the references at 1, 2 and 4 ranks give (docs/validation.md).
# 1e-4 holds that and stays 3000x below the elastic loader's data-order band.
BAND_CAP = 1e-4


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    out = tmp_path_factory.mktemp("validate_global_order")
    cmd = [sys.executable, str(SCRIPT), "--recipe", "recipes/llama_gefen_global_order.toml", "--backend", "gloo",
           "--no-dropped-state",
           "--steps-before", str(CI["steps_before"]), "--steps-after", str(CI["steps_after"]),
           "--global-batch", str(CI["global_batch"]), "--local-batch", str(CI["local_batch"]),
           "--pairs", "2:1", "--out", str(out), *processes.validate_launcher(),
           "--reference-cache", str(suite_cache.reference_cache(tmp_path_factory))]
    proc = processes.run(cmd, cwd=ROOT, timeout=850)  # below pytest-timeout's 900 s: a hang fails here, ranks stopped
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return proc, report, out


def test_resume_at_one_rank_reads_the_uninterrupted_batches(validated):
    proc, report, out = validated
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert report["data_order"] == "global"
    pair = report["pairs"][0]
    assert pair["pair"] == "2->1" and pair["batches_equal"] is True and pair["failures"] == []
    assert "every resumed run read the uninterrupted run's batches" in proc.stdout
    log = (out / "2-to-1" / "train.log").read_text()
    assert "gradient accumulation steps 4" in log  # 8 samples = 4 microbatches of 2 on one rank
    start = CI["steps_before"] * CI["global_batch"]
    assert f"resumes at sample {start}" in log and "saved at dp 2, now dp 1" in log


def test_losses_are_compared_step_by_step_with_a_measured_tolerance(validated):
    proc, report, _ = validated
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    band, pair = report["loss_band"], report["pairs"][0]
    window = [str(t) for t in range(CI["steps_before"] + 1, CI["steps_before"] + CI["steps_after"] + 1)]
    assert sorted(pair["step_deviations"]) == window
    print("\nstep  |resumed at 1 - uninterrupted at 2|")
    for t in window:
        print(f"{t:>4}  {pair['step_deviations'][t]:.1e}")
    print(f"tolerance {pair['loss_band']:.1e}: rerun deviation {band['rerun_deviation']:.1e}, "
          f"reduction-order deviation {band['reduction_order_deviation']:.1e}")
    # The tolerance is what the measurements give, nothing assumed.
    assert band["rerun_size"] == 2 and band["references"] == [1, 2]
    assert pair["loss_band"] == band["band"] == pytest.approx(
        max(bands.LOG_RESOLUTION, bands.LOSS_K * max(band["rerun_deviation"], band["reduction_order_deviation"])))
    assert max(pair["step_deviations"].values()) <= pair["loss_band"]
    # CPU runs are deterministic: the same-size rerun repeats the curve to the
    # logged decimals; the same batches in another reduction order stay at
    # float rounding, orders of magnitude below a data-order band (~0.4).
    assert band["rerun_deviation"] <= bands.LOG_RESOLUTION
    assert band["band"] <= BAND_CAP, band
    assert "loss deviation per step" in proc.stdout


# ------------------------------------------------ pieces, no training (fast)
def _run(tmp_path, name, nproc, losses, batches=None):
    folder = tmp_path / name
    (folder / "batches").mkdir(parents=True)
    for step, ids in (batches or {}).items():
        with open(folder / "batches" / "batches-dp1-rank0.jsonl", "a") as f:
            f.write(json.dumps({"start": (step - 1) * 4, "sample_ids": ids}) + "\n")
    return runs.Run(str(folder), nproc, losses, 1.0)


def test_order_band_and_pair_tolerances(tmp_path):
    s = runs.Settings(recipe="recipes/llama_gefen_global_order.toml", steps_before=2, steps_after=2)
    refs = {1: _run(tmp_path, "r1", 1, {1: 8.0, 2: 7.5, 3: 7.0, 4: 6.6}),
            2: _run(tmp_path, "r2", 2, {1: 8.0, 2: 7.5, 3: 7.00002, 4: 6.60004})}
    rerun = _run(tmp_path, "re", 1, {1: 8.0, 2: 7.5, 3: 7.0, 4: 6.60001})
    band = bands.order_band(refs, rerun, s)
    assert band["rerun_deviation"] == pytest.approx(1e-5) and band["reduction_order_deviation"] == pytest.approx(4e-5)
    assert bands.pair_loss_band(1, 1, band) == pytest.approx(3e-5)  # LOSS_K x the rerun's
    assert bands.pair_loss_band(1, 2, band) == pytest.approx(1.2e-4)  # LOSS_K x the reduction order's
    exact = bands.order_band(refs | {2: refs[1]}, _run(tmp_path, "re2", 1, dict(refs[1].losses)), s)
    assert bands.pair_loss_band(2, 1, exact) == bands.LOG_RESOLUTION  # nothing measured: one logged unit
    assert bands.pair_loss_band(2, 1, {"band": 0.3}) == 0.3 and bands.pair_loss_band(2, 2, {"band": 0.3}) == 0.0


def test_compare_batches_names_the_step_and_samples(tmp_path):
    ref = _run(tmp_path, "ref", 2, {}, {1: [0, 1, 2, 3], 2: [4, 5, 6, 7]})
    same = _run(tmp_path, "same", 1, {}, {2: [7, 6, 5, 4]})
    assert compare_batches(ref, same, 4, range(2, 3)) == []
    other = _run(tmp_path, "other", 1, {}, {2: [4, 5, 6, 9]})
    assert compare_batches(ref, other, 4, range(2, 3)) == [
        "step 2 read other samples than the uninterrupted run at 2 rank(s) "
        "(1 not in it, e.g. [9]; 1 missing, e.g. [7])"]
    twice = _run(tmp_path, "twice", 1, {}, {2: [4, 5, 6, 7, 7]})
    assert compare_batches(ref, twice, 4, range(2, 3)) == ["step 2 read some samples twice"]
    assert "no batch record for step 3" in compare_batches(ref, same, 4, range(2, 4))[0]
