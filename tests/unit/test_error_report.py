"""The entry point's report of an error (gefen_titan.error_report): a user's error is one
block on rank 0 and in torchelastic's error file, exit 1, no traceback; anything else
passes through untouched."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.data.indexed import IndexedDataError
from gefen_titan.error_report import TRACEBACK_ENV, format_block, reported
from gefen_titan.errors import UserError
from gefen_titan.recipe import RecipeError


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    return tmp_path / "error.json"


def test_user_error_is_one_block_in_the_error_file_and_exit_1(env, capsys):
    with pytest.raises(SystemExit) as exit_, reported():
        raise RecipeError("recipes/x.toml: [optimizer] lrr: unknown key (known: lr)")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err == format_block(RecipeError("recipes/x.toml: [optimizer] lrr: unknown key (known: lr)")) + "\n"
    assert "Traceback" not in err and err.startswith("gefen-titan: error: recipes/x.toml: [optimizer] lrr")
    assert TRACEBACK_ENV in err
    data = json.loads(env.read_text())
    # torchrun prints py_callstack as the failure's "traceback"
    assert data["message"]["extraInfo"]["py_callstack"] == err.rstrip("\n")
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0


def test_other_ranks_only_write_the_error_file(env, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit), reported():
        raise GefenCheckpointError("refused")
    assert capsys.readouterr().err == ""
    assert "refused" in json.loads(env.read_text())["message"]["message"]


def test_without_an_error_file_every_rank_prints(env, capsys, monkeypatch):
    """Another launcher: no error file carries rank 1's message, so rank 1 prints it."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    with pytest.raises(SystemExit), reported():
        raise GefenCheckpointError("refused")
    assert capsys.readouterr().err.startswith("gefen-titan: error: refused")


LAGGARD = """
import sys
from gefen_titan import error_report
from gefen_titan.errors import UserError
error_report.LAGGARD_WAIT_S = float(sys.argv[1])
with error_report.reported():
    raise UserError("refused on every rank")
"""


def _laggard(tmp_path, wait_s):
    error_file = tmp_path / "error.json"
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_ERROR_FILE": str(error_file)}
    env.pop(TRACEBACK_ENV, None)
    proc = subprocess.Popen([sys.executable, "-c", LAGGARD, str(wait_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, error_file


def test_a_laggard_rank_stopped_by_torchrun_is_not_another_failure(tmp_path):
    """Local rank 1 writes its error file, then waits; torchrun's SIGTERM (sent once local
    rank 0 has failed) ends it with status 0, so torchrun's summary does not list the
    same message again under "Failures"."""
    proc, error_file = _laggard(tmp_path, 600)
    deadline = time.monotonic() + 120
    while not error_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()  # still waiting, not exited with the error
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "refused on every rank" in json.loads(error_file.read_text())["message"]["message"]
    assert err == ""  # rank 1 prints nothing: rank 0 does


def test_a_laggard_rank_not_stopped_fails_after_its_wait(tmp_path):
    """A message only rank 1 raised: nobody stops it, so it fails itself after the wait."""
    proc, error_file = _laggard(tmp_path, 0.2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    assert "refused on every rank" in json.loads(error_file.read_text())["message"]["message"]


def test_traceback_switch_reraises(env, monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(IndexedDataError), reported():
        raise IndexedDataError("cut short")
    assert not env.exists()


def test_unexpected_errors_pass_through(env, capsys):
    with pytest.raises(KeyError), reported():
        raise KeyError("bug")
    assert not env.exists() and capsys.readouterr().err == ""


@pytest.mark.parametrize("cls", [
    "gefen_titan.recipe.errors.RecipeError",
    "gefen_titan.checkpoint.errors.GefenCheckpointError",
    "gefen_titan.checkpoint.format.digests.CorruptCheckpointError",
    "gefen_titan.data.indexed.IndexedDataError",
    "gefen_titan.data.global_loader.DataOrderError",
    "gefen_titan.data.registry.UnknownLoaderError",
    "gefen_titan.data.stream_reshard.StreamNotResumable",
    "gefen_titan.data.elastic_dataset.DataLoaderReshardError",
    "gefen_titan.distributed.layout.LayoutError",
    "gefen_titan.optim.kinds.gefen.per_rank_regions.UnsupportedLayout",
    "gefen_titan.optim.block_periods.BlockingError",
    "gefen_titan.optim.live_state.LiveStateError",
])
def test_the_package_user_errors_are_reported_as_such(cls):
    import importlib
    module, name = cls.rsplit(".", 1)
    assert issubclass(getattr(importlib.import_module(module), name), UserError)
