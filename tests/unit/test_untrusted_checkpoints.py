"""Checkpoints from elsewhere (docs/checkpoints.md, "Threat model"): reading one never runs code from it,
a checkpoint whose save wrote ``.digests`` never loads without them, and with a key only a holder of the
key can write one that loads. One process, the real GefenCheckpointManager around stand-in components.

A planted payload is a pickle whose ``__reduce__`` calls ``io.open(sentinel, "w")``: had anything
unpickled it, the sentinel file would exist.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import digest_format, digests, unpickling
from gefen_titan.checkpoint.io import storage
from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from gefen_titan.ckpt_tools.view import Checkpoint, CkptError
from tests.helpers.loader_checkpoint import Blob
from tests.helpers.untrusted import Payload, as_pre_digest, plant_in_metadata, rewrite_digests

ROOT = Path(__file__).resolve().parents[2]
KEY_ENV = "GEFEN_TEST_DIGEST_KEY"


class Extra:
    """A checkpointed component with a tensor and a byte entry (``note``)."""

    def __init__(self, note=None) -> None:
        self.value = torch.arange(6.0)
        self.note = {"seen": 3, "name": "plain"} if note is None else note
        self.loaded: dict | None = None

    def state_dict(self):
        return {"v": self.value, "note": self.note}

    def load_state_dict(self, sd):
        self.loaded = dict(sd)


def _manager(folder: Path, extra: Extra, **config) -> GefenCheckpointManager:
    cfg = GefenCheckpointManager.Config(enable=True, folder=str(folder), interval=1, keep_latest_k=0,
                                        last_save_model_only=False, **config)
    return cfg.build(dataloader=Blob(), model_parts=[torch.nn.Linear(2, 2)], optimizers=Blob(), lr_schedulers=Blob(),
                     states={"extra": extra}, sd_adapter=None, base_folder="")


def _save(tmp_path: Path, note=None, **config) -> Path:
    """Step 1 saved by the manager; the step folder."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        _manager(tmp_path / "ckpt", Extra(note), **config).save(curr_step=1)
    return tmp_path / "ckpt" / "step-1"


def _load(tmp_path: Path, note=None, **config) -> Extra:
    """Step 1 loaded; ``note``: the load destination's byte entry (DCP flattens it: the saved layout's)."""
    extra = Extra(note)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        assert _manager(tmp_path / "ckpt", extra, **config).load(step=1)
    return extra


# ------------------------------------------------------------------ no code runs
@pytest.mark.parametrize("era", ["v3", "pre-digest"])
def test_a_payload_in_metadata_never_runs(tmp_path, era):
    """``.metadata`` is unpickled with DCP's metadata classes only: in the resume, ``ckpt`` tools and ``load_all``,
    for a checkpoint with a consistent ``.digests`` and for one from before digests."""
    sentinel = tmp_path / "pwned"
    if era == "v3":
        step = _save(tmp_path)
        rewrite_digests(step, plant_in_metadata(step, sentinel))
    else:
        step = _save(tmp_path)
        as_pre_digest(step)
        plant_in_metadata(step, sentinel)
    with pytest.raises(GefenCheckpointError, match=r"\.metadata names io\.open.*Nothing was loaded"):
        _load(tmp_path)
    with pytest.raises(unpickling.ForbiddenObjectError):
        storage.load_all(step)
    with pytest.raises(CkptError, match="io.open"):
        Checkpoint(str(step))
    report = verify_checkpoint(str(step))
    assert report["verdict"] == "failed" and "io.open" in json.dumps(report["problems"])
    assert not sentinel.exists()
    # DCP's own reader is what we replace: it would have run the payload.
    from torch.distributed.checkpoint import FileSystemReader
    FileSystemReader(str(step)).read_metadata()
    assert sentinel.exists()


def test_a_payload_in_a_byte_entry_is_refused_naming_it(tmp_path):
    """Byte entries load with ``weights_only=True``: the refusal names the entry and the global; plain data loads."""
    sentinel = tmp_path / "pwned"
    step = _save(tmp_path, note=Payload(sentinel))  # saving pickles the reference, never calls it
    assert not sentinel.exists()
    with pytest.raises(GefenCheckpointError, match=r"entry extra\.note names io\.open"):
        _load(tmp_path, note="")
    with pytest.raises(GefenCheckpointError, match=r"extra\.note"):
        storage.load_all(step)
    report = verify_checkpoint(str(step))
    assert report["verdict"] == "failed"
    assert any(p["entry"] == "extra.note" and "io.open" in p["what"] for p in report["problems"])
    assert not sentinel.exists()


def test_plain_byte_entries_still_load(tmp_path):
    _save(tmp_path, note={"seen": 7, "names": ("a", "b"), "t": torch.ones(2)})
    got = _load(tmp_path, note={"seen": 0, "names": (), "t": torch.zeros(2)}).loaded
    assert got["note"]["seen"] == 7 and got["note"]["names"] == ("a", "b") and torch.equal(got["note"]["t"],
                                                                                        torch.ones(2))


def test_a_data_loader_state_is_plain_data_only():
    """torchtitan pickles one loader state per rank inside a byte entry: read with plain data only."""
    assert unpickling.loads_loader_state(pickle.dumps({"a": [1, 2], "b": b"x"}), "dataloader.dp_rank_0") == {
        "a": [1, 2], "b": b"x"}
    with pytest.raises(unpickling.ForbiddenObjectError, match=r"dataloader\.dp_rank_0 names io\.open"):
        unpickling.loads_loader_state(pickle.dumps(Payload(Path("/nonexistent/x"))), "dataloader.dp_rank_0")


# ------------------------------------------------------------------ integrity fails closed
def test_a_checkpoint_without_its_digests_is_refused_unless_opted_out(tmp_path):
    step = _save(tmp_path)
    (step / digests.FILE).unlink()
    with pytest.raises(GefenCheckpointError, match=r"\.digests: missing.*checkpoint\.load_without_digests = true"):
        _load(tmp_path)
    assert _load(tmp_path, load_without_digests=True).loaded["note"]["seen"] == 3
    report = verify_checkpoint(str(step))
    assert report["verdict"] == "failed" and report["problems"][0]["file"] == digests.FILE


def test_a_checkpoint_from_before_digests_loads_with_a_warning_and_verifies_unchecked(tmp_path, caplog):
    step = _save(tmp_path)
    as_pre_digest(step)
    assert not digest_format.expects_digests(storage.read_metadata(step))
    with caplog.at_level("WARNING"):
        assert _load(tmp_path).loaded["note"]["seen"] == 3
    assert "UNCHECKED" in caplog.text
    assert verify_checkpoint(str(step))["verdict"] == "unchecked"


def _cli_verify(step: Path, *extra: str, env: dict | None = None) -> int:
    return subprocess.run([sys.executable, "-m", "gefen_titan.ckpt_tools", "verify", str(step), *extra], cwd=ROOT,
                          capture_output=True, env={**os.environ, **(env or {})}, timeout=300).returncode


@pytest.mark.parametrize("damage", ["truncated digests", "extended digests", "appended data bytes",
                                    "unlisted data file"])
def test_bytes_the_digests_do_not_account_for_are_refused(tmp_path, damage):
    step = _save(tmp_path)
    data = step / "__0_0.distcp"
    if damage == "truncated digests":
        raw = (step / digests.FILE).read_bytes()
        (step / digests.FILE).write_bytes(raw[:-5])
    elif damage == "extended digests":
        with open(step / digests.FILE, "ab") as f:
            f.write(b"0 1 0123456789abcdef\n")
    elif damage == "appended data bytes":
        with open(data, "ab") as f:
            f.write(b"\0" * 64)
    else:
        (step / "__7_0.distcp").write_bytes(data.read_bytes())
    with pytest.raises(GefenCheckpointError, match="is corrupt"):
        _load(tmp_path)
    assert verify_checkpoint(str(step))["verdict"] == "failed"


def test_verify_exit_status_tells_verified_from_unchecked(tmp_path):
    step = _save(tmp_path / "a")
    assert _cli_verify(step) == 0
    old = tmp_path / "b" / "step-1"
    dcp.save({"x": {"v": torch.ones(3)}}, storage_writer=storage.storage_writer(old, digests=False), no_dist=True)
    assert _cli_verify(old) == 3
    (step / digests.FILE).unlink()
    assert _cli_verify(step) == 1


# ------------------------------------------------------------------ authenticity with a key
def test_with_a_key_only_the_keys_holder_writes_a_checkpoint_that_loads(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "correct horse battery staple")
    step = _save(tmp_path, digest_key_env=KEY_ENV)
    assert digests.KEYED_ALGORITHM in (step / digests.FILE).read_bytes().split(b"\n")[0].decode()
    assert b"correct horse" not in b"".join(p.read_bytes() for p in step.iterdir())  # the key is never written
    assert _load(tmp_path, digest_key_env=KEY_ENV).loaded["note"]["seen"] == 3
    assert _cli_verify(step, "--digest-key-env", KEY_ENV) == 0

    # Without the key: a signed checkpoint cannot be checked, so it is refused.
    with pytest.raises(GefenCheckpointError, match="signed with a key"):
        _load(tmp_path)
    # Another key: the index's MAC does not match.
    monkeypatch.setenv(KEY_ENV, "another key")
    with pytest.raises(GefenCheckpointError, match="does not match the MAC"):
        _load(tmp_path, digest_key_env=KEY_ENV)
    monkeypatch.setenv(KEY_ENV, "correct horse battery staple")

    # A writer without the key rewrites a data file and .digests together (and plants a payload in
    # .metadata): refused before .metadata is unpickled.
    sentinel = tmp_path / "pwned"
    clean = plant_in_metadata(step, sentinel, digests.key_from_env(KEY_ENV))
    rewrite_digests(step, clean)
    with pytest.raises(GefenCheckpointError, match="carries no MAC"):
        _load(tmp_path, digest_key_env=KEY_ENV)
    rewrite_digests(step, clean, key=b"a guess")
    with pytest.raises(GefenCheckpointError, match="does not match the MAC"):
        _load(tmp_path, digest_key_env=KEY_ENV)
    assert _cli_verify(step, "--digest-key-env", KEY_ENV) == 1
    # The opt-out is for stripped folders, not for authenticity.
    (step / digests.FILE).unlink()
    with pytest.raises(GefenCheckpointError, match="without its MAC is refused"):
        _load(tmp_path, digest_key_env=KEY_ENV, load_without_digests=True)
    assert not sentinel.exists()


def test_a_named_but_unset_key_variable_stops_the_job(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(GefenCheckpointError, match=f"{KEY_ENV}, which is not set"):
        _manager(tmp_path / "ckpt", Extra(), digest_key_env=KEY_ENV)


def test_the_allowlists_are_what_our_own_saves_need():
    """Nothing beyond DCP's metadata classes is allowed in .metadata, and nothing callable with effects."""
    modules = {m for m, _ in unpickling.METADATA_GLOBALS}
    assert modules <= {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                       "torch.serialization", "torch", "collections", "pathlib"}
    assert unpickling.ENTRY_GLOBALS == ()
    # A dtype is allowed by name, any other torch attribute is not.
    buf = io.BytesIO()
    pickle.dump(torch.float16, buf)
    assert unpickling.unpickle_metadata(buf.getvalue()) is torch.float16
    with pytest.raises(unpickling.ForbiddenObjectError, match=r"torch\.serialization\.load"):
        unpickling.unpickle_metadata(pickle.dumps(torch.load))
