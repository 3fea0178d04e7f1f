"""``scripts/gpu_check.sh``'s verdict (``benchmarks.gpu_check``), without CUDA.

A stage the time budget left out proved nothing: it is reported "not run"
and the run is not a pass (status ``incomplete``, exit 4), whatever the
stages that ran gave. Checked on ``verdict`` (stage results -> status and
exit code) and through ``main`` with CUDA faked, the stages stubbed and a
clock that the first stage runs past the budget.
"""

from __future__ import annotations

import json
import types

import pytest

from benchmarks import gpu_check as gc

PASSED = {"ok": True, "why": ""}
FAILED = {"ok": False, "why": "kernel tests failed"}
NOT_RUN = {"ok": None, "skipped": "not run: budget: 460 s elapsed of 450"}
NO_CUDA = {"ok": None, "skipped": "no CUDA"}


def test_exit_codes_are_distinct():
    assert len({gc.OK, gc.FAILED, 2, gc.NO_CUDA, gc.NOT_RUN}) == 5 and gc.OK == 0


@pytest.mark.parametrize("stages,cuda,want", [
    ({"kernels": PASSED, "train": PASSED}, True, ("ok", gc.OK)),
    ({"kernels": PASSED, "train": NOT_RUN}, True, ("incomplete", gc.NOT_RUN)),
    ({"kernels": NOT_RUN}, True, ("incomplete", gc.NOT_RUN)),
    ({}, True, ("incomplete", gc.NOT_RUN)),
    ({"kernels": FAILED, "train": NOT_RUN}, True, ("failed", gc.FAILED)),
    ({"kernels": NO_CUDA, "checkpoint": PASSED}, False, ("no_cuda", gc.NO_CUDA)),
    ({"kernels": NO_CUDA, "checkpoint": NOT_RUN}, False, ("no_cuda", gc.NO_CUDA)),
    ({"kernels": NO_CUDA, "checkpoint": FAILED}, False, ("failed", gc.FAILED)),
])
def test_verdict(stages, cuda, want):
    assert gc.verdict(stages, cuda) == want


def test_a_stage_past_the_budget_is_not_run_and_the_run_is_no_pass(tmp_path, monkeypatch, capsys):
    now = [0.0]

    def kernels(args, work):  # passes, and takes longer than the whole budget
        now[0] += 100.0
        return dict(PASSED)

    def bandwidth(args, work):  # pragma: no cover - must not be reached
        raise AssertionError("a stage started after the budget")

    monkeypatch.setattr(gc, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(gc, "stage_kernels", kernels)
    monkeypatch.setattr(gc, "stage_bandwidth", bandwidth)
    monkeypatch.setattr(gc, "_env", lambda: {"cuda": True})
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    out = tmp_path / "r.json"
    code = gc.main(["--stages", "kernels,bandwidth", "--budget-s", "50", "--work", str(tmp_path), "--out", str(out)])
    assert code == gc.NOT_RUN
    report = json.loads(out.read_text())
    assert report["status"] == "incomplete"
    assert report["stages"]["kernels"]["ok"] is True
    assert report["stages"]["bandwidth"] == {"ok": None, "skipped": "not run: budget: 100 s elapsed of 50"}
    printed = capsys.readouterr().out
    assert "bandwidth: NOT RUN" in printed and "NOT A PASS: bandwidth not run" in printed



def test_the_muon_momentum_check_passes_on_cpu_and_can_fail(monkeypatch):
    # CPU: the shard check (the fused half needs CUDA).
    good = gc.muon_momentum_check("cpu", fused=False, rows=67, cols=768, steps=2)
    assert good["ok"] and good["shards_equal_whole"] and "fused_equals_torch" not in good
    # A momentum that depended on the shard would be caught.
    from gefen_titan.optim import gefenx as gx

    real = gx.muon_momentum

    def shard_dependent(optim, fqn, p, group, grad):
        dense = real(optim, fqn, p, group, grad)
        return dense + 1e-3 if grad.shape[0] < 67 else dense

    monkeypatch.setattr(gx, "muon_momentum", shard_dependent)
    bad = gc.muon_momentum_check("cpu", fused=False, rows=67, cols=768, steps=2)
    assert bad["ok"] is False and "shards_equal_whole" in bad["why"]


def test_the_factored_check_passes_on_cpu_and_can_fail(monkeypatch):
    good = gc.factored_check("cpu", rows=67, cols=512, steps=2)
    assert good["ok"] and good["sums_split_equal_whole"] and good["cuda_equals_cpu"] and good["finite"]
    # Float sums (whose rounding depends on where a row or column is cut) would be caught.
    from gefen_titan.optim import axis_sums

    real = axis_sums.sums

    def cut_dependent(x, dim, codes, n):
        out = real(x, dim, codes, n)
        return out + 1 if x.shape[dim] < n else out

    monkeypatch.setattr(axis_sums, "sums", cut_dependent)
    bad = gc.factored_check("cpu", rows=67, cols=512, steps=1)
    assert bad["ok"] is False and "sums_split_equal_whole" in bad["why"]


def test_the_converters_stage_trains_each_converter_its_gpu_can_run(tmp_path, monkeypatch):
    """float8, then mxfp8, each a recipe with that converter trained as ``train`` is; a
    converter the GPU's compute capability cannot run is skipped, not failed."""
    from gefen_titan.recipe.converters import converters_from_recipe
    from gefen_titan.recipe.files import read_recipe_tables

    trained = []

    def train(args, work, recipe, name):
        (converter,) = read_recipe_tables(recipe)["model"]["converters"]
        converters_from_recipe([converter], recipe)  # a table torchtitan's converter Config takes
        trained.append((converter["kind"], name))
        return dict(PASSED)

    monkeypatch.setattr(gc, "stage_train", train)
    for capability, kinds in (((9, 0), ["float8"]), ((10, 0), ["float8", "mxfp8"])):
        trained.clear()
        props = types.SimpleNamespace(major=capability[0], minor=capability[1])
        monkeypatch.setattr("torch.cuda.get_device_properties", lambda _, props=props: props)
        result = gc.stage_converters(None, tmp_path)
        assert [k for k, _ in trained] == kinds and result["ok"] is True and result["why"] == ""
        if "mxfp8" not in kinds:
            assert result["mxfp8"] == {"ok": None, "skipped": "needs compute capability 10.0+, this is 9.0"}
    # A converter that trains badly fails the stage, naming it.
    monkeypatch.setattr(gc, "stage_train", lambda *a: {"ok": False, "why": "exit 1"})
    (tmp_path / "float8_train.log").write_text("ImportError: torchao is not installed. Please install it")
    (tmp_path / "mxfp8_train.log").write_text("")
    bad = gc.stage_converters(None, tmp_path)
    assert bad["ok"] is False and bad["why"] == (
        "float8: torchao is not installed (the converters need it: pip install torchao); mxfp8: exit 1")


def test_the_converters_stage_is_skipped_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "_env", lambda: {"cuda": False})
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert "converters" in gc.STAGES
    out = tmp_path / "r.json"
    assert gc.main(["--stages", "converters", "--work", str(tmp_path), "--out", str(out)]) == gc.NO_CUDA
    assert json.loads(out.read_text())["stages"]["converters"] == {"ok": None, "skipped": "no CUDA"}
