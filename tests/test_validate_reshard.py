"""scripts/validate_reshard.py end to end on CPU (gloo): the standard set
2->4, 4->2, 2->1 of the debug recipe passes, with the state checks the
adapter promises, and a broken resume (optimizer state dropped) makes the
script fail, naming the pair and the figure.

Small settings (``CI_SETTINGS``: save at step 4, 3 more steps, global batch
8 of local 2). The reference runs (at 1, 2 and 4 ranks: every size of the
pairs) are kept in a session cache shared with tests/test_recipe_regression.py
(they are the runs of llama_gefen_dp1.toml, llama_gefen.toml = llama_gefen_dp2.toml
and llama_gefen_dp4.toml), so each is trained once per session.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "validate_reshard.py"
sys.path.insert(0, str(ROOT / "scripts"))
import validate_reshard as vr  # noqa: E402

CI = vr.CI_SETTINGS
CI_ARGS = ["--recipe", "recipes/llama_gefen.toml", "--backend", "gloo",
           "--steps-before", str(CI["steps_before"]), "--steps-after", str(CI["steps_after"]),
           "--global-batch", str(CI["global_batch"]), "--local-batch", str(CI["local_batch"])]


def reference_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "reshard_reference_cache"


def validate(tmp_path_factory, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, str(SCRIPT), *CI_ARGS, "--out", str(out),
           "--reference-cache", str(reference_cache(tmp_path_factory)), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    report = out / "report.json"
    return proc, (json.loads(report.read_text()) if report.exists() else {})


@pytest.fixture(scope="module")
def standard(tmp_path_factory):
    out = tmp_path_factory.mktemp("validate_standard")
    proc, report = validate(tmp_path_factory, out, "--pairs", "2:4,4:2,2:1")
    return proc, report, out


def _pair(report, name):
    return next(p for p in report["pairs"] if p["pair"] == name)


def test_standard_set_passes_with_table_and_plot(standard):
    proc, report, out = standard
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "all pairs within tolerance" in proc.stdout
    assert "gloo on CPU" in proc.stdout  # says which backend it used
    for pair in ("2->4", "4->2", "2->1"):
        assert any(line.startswith(pair) and line.rstrip().endswith("ok") for line in proc.stdout.splitlines()), pair
    png = Path(report["plot"])
    assert png == out / "loss_curves.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p["pair"] for p in report["pairs"]] == ["2->4", "4->2", "2->1"]
    steps = list(range(CI["steps_before"] + 1, CI["steps_before"] + CI["steps_after"] + 1))
    for p in report["pairs"]:
        assert sorted(int(s) for s in p["resumed_losses"]) == steps
        assert p["failures"] == []
        assert p["checkpoint"]["total"] > 0 and p["save_seconds"] > 0 and p["load_seconds"] > 0


def test_state_after_load_exact_where_promised_else_within_bounds(standard):
    _, report, _ = standard
    for p in report["pairs"]:
        st = p["state"]
        assert st["params_exact"] and st["exact_held"] and not st["problems"], (p["pair"], st)
    split = _pair(report, "2->4")["state"]
    # Every new shard lies on whole blocks of one old shard: adopted as is.
    assert split["exact_promised_fraction"] == 1.0
    assert split["momentum_rel_l2"] == split["vmean_rel_l2"] == split["first_update_rel_l2"] == 0.0
    for name in ("4->2", "2->1"):  # merges: one requantization
        st = _pair(report, name)["state"]
        assert 0 < st["momentum_rel_l2"] <= vr.TOL_MOMENTUM
        assert st["vmean_rel_l2"] <= vr.TOL_VMEAN
        assert 0 < st["first_update_rel_l2"] <= vr.TOL_UPDATE
    # ~1 byte/param of optimizer state on disk
    assert 1.0 < report["pairs"][0]["checkpoint"]["optimizer"] / report["parameters"] < 1.1


def test_loss_band_is_measured_not_assumed(standard):
    _, report, _ = standard
    band = report["loss_band"]
    assert band["references"] == [1, 2, 4]  # every size of the pairs, targets included
    assert band["sigma_second_difference"] > 0 and band["sigma_between_references"] > 0
    assert band["band"] == pytest.approx(max(vr.LOSS_FLOOR, vr.LOSS_K * band["sigma"]))
    for p in report["pairs"]:
        assert p["loss_deviation"] <= band["band"]


def test_dropped_optimizer_state_fails_naming_pair_and_figure(standard, tmp_path_factory):
    """A resume that loads everything but the optimizer
    (``--checkpoint.exclude_from_loading optimizer``) must fail the script."""
    out = tmp_path_factory.mktemp("validate_fault")
    proc, report = validate(tmp_path_factory, out, "--pairs", "4:2", "--inject-fault", "drop-optimizer")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-6000:]
    assert "reusing" in proc.stdout  # the reference came from the shared cache
    err = proc.stderr
    assert "FAILED" in err
    assert "4->2: first-update error 1 > 0.03" in err
    assert "4->2: momentum error 1 > 0.02" in err
    assert "have no optimizer state after the load" in err
    assert f"plot: {out / 'loss_curves.png'}" in err
    assert report["pairs"][0]["failures"] and report["fault"] == "drop-optimizer"


# ------------------------------------------------ pieces, no training (fast)
def test_equal_runs_share_one_identity():
    s = vr.Settings(recipe="recipes/llama_gefen.toml", **CI)
    base2 = vr.run_identity("recipes/llama_gefen.toml", 2, s.overrides(2))
    assert base2 == vr.run_identity("recipes/llama_gefen_dp2.toml", 2, s.overrides(2))
    assert base2 != vr.run_identity("recipes/llama_gefen.toml", 4, s.overrides(4))
    assert base2 != vr.run_identity("recipes/llama_gefen_mixed.toml", 2, s.overrides(2))
    assert base2 != vr.run_identity("recipes/llama_gefen.toml", 2, s.overrides(2) + ["--optimizer.lr", "1e-3"])


def test_second_difference_noise_measures_batch_noise():
    import random

    rng = random.Random(0)
    sigma = 0.05
    curve = {t: 8.0 - 0.01 * t + rng.gauss(0, sigma) for t in range(1, 2001)}
    # the spread of the difference of two runs' losses: sqrt(2) sigma
    assert vr.second_difference_noise(curve) == pytest.approx(sigma * 2 ** 0.5, rel=0.05)
    assert vr.second_difference_noise({1: 8.0, 2: 7.0, 3: 6.0, 4: 5.0}) == 0.0  # a straight line is no noise


def test_hook_override_value_reads_back_as_toml():
    import tomllib

    value = vr.toml_value(["a.b", ["gefen_titan.validate_hooks.dump_state", {"dir": "/tmp/x y", "save_steps": [4]}]])
    assert tomllib.loads(f"v = {value}")["v"] == ["a.b", ["gefen_titan.validate_hooks.dump_state",
                                                         {"dir": "/tmp/x y", "save_steps": [4]}]]
