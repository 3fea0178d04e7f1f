"""Verify = load for values (issue 50, item 4): a Gefen magnitude or second moment the resume refuses
(non-finite or negative: ``kinds.nonnegative_problem``, run by the adapters) fails ``ckpt verify`` too,
and ``ckpt export`` and ``ckpt convert`` refuse it before they write anything; a ``.digests`` index of
wrong types (rewritten to match, no key needed) is a refusal of ``verify`` and ``export`` with exit
status 1, not a traceback. One process, the tiny checkpoint of ``tests.helpers.tiny_checkpoint``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import digests, schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools import cli
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from tests.helpers.tiny_checkpoint import STEP, resume, save
from tests.helpers.untrusted import rewrite_digests

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    save(root)
    return root


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "case"
    shutil.copytree(saved, root)
    return root, root / "ckpt" / f"step-{STEP}"


def _entry(kind: str, fqn: str) -> str:
    return "optimizer." + schema.PATTERNS[kind].format(fqn=fqn)


def _plant(step: Path, entry: str, index: int, value: float) -> None:
    """One fp32 value of a raw entry's stored item set in place, ``.digests`` rewritten to match."""
    md = storage.read_metadata(step)
    (item,) = [i for i in md.storage_data if i.fqn == entry]
    info = md.storage_data[item]
    f = step / info.relative_path
    data = bytearray(f.read_bytes())
    values = torch.frombuffer(bytearray(data[info.offset:info.offset + info.length]), dtype=torch.float32).clone()
    values[index] = value
    data[info.offset:info.offset + info.length] = values.numpy().tobytes()
    f.write_bytes(bytes(data))
    rewrite_digests(step, md)


# The tiny checkpoint's 0.weight (16 x 16, period 16) has the default factored second moment: its grid
# holds 16 magnitudes alone, its vrow and vcol 16 floats each; 1.weight (a vector: always block, period 1)
# has a grid of 16 (magnitude, vmean) pairs.
@pytest.mark.parametrize("kind, fqn, index, value, what, count", [
    ("grid", "0.weight", 0, -1.0, "magnitude", 16), ("vrow", "0.weight", 3, float("nan"), "vrow", 16),
    ("vcol", "0.weight", 5, float("-inf"), "vcol", 16), ("grid", "1.weight", 1, float("nan"), "vmean", 32),
    ("grid", "1.weight", 2, float("-inf"), "magnitude", 32)])
def test_a_value_the_resume_refuses_fails_verify_export_and_convert(saved, tmp_path, capsys, kind, fqn, index, value,
                                                                    what, count):
    root, step = _copy(saved, tmp_path)
    entry = _entry(kind, fqn)
    _plant(step, entry, index, value)
    with pytest.raises(GefenCheckpointError, match=f"{fqn}: non-finite or negative {what} in the checkpoint"):
        resume(root)
    report = verify_checkpoint(str(step))
    bad = f"a magnitude or second moment with 1 of its {count} values non-finite or negative"
    assert not report["ok"] and any(p["entry"] == entry and bad in p["what"] for p in report["problems"]), \
        report["problems"]
    out = tmp_path / "out.pt"
    assert cli.main(["export", str(step), str(out)]) == cli.BAD
    assert bad in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("out.pt*"))
    converted = tmp_path / "converted" / f"step-{STEP}"
    assert cli.main(["convert", str(step), str(converted), "--to", "adamw"]) == cli.BAD
    assert f"{fqn}: non-finite or negative {what} in " in capsys.readouterr().err
    assert not (tmp_path / "converted").exists() or not any((tmp_path / "converted").iterdir())


def test_the_unedited_copy_exports_and_converts(saved, tmp_path):
    _, step = _copy(saved, tmp_path)
    assert cli.main(["export", str(step), str(tmp_path / "out.pt")]) == cli.OK
    assert cli.main(["convert", str(step), str(tmp_path / "converted" / f"step-{STEP}"), "--to", "adamw"]) == cli.OK


def _index(step: Path, change) -> None:
    """``.digests``' index (its line 2) passed through ``change(doc)``, its digest on line 1 to match."""
    head, line, rest = (step / digests.FILE).read_bytes().split(b"\n", 2)
    doc = change(json.loads(line))
    line = json.dumps(doc, separators=(",", ":")).encode()
    magic, version, algorithm, _ = head.decode().split(" ")
    (step / digests.FILE).write_bytes(f"{magic} {version} {algorithm} {digests.hexdigest(line)}\n".encode()
                                      + line + b"\n" + rest)


@pytest.mark.parametrize("change, text", [
    (lambda doc: {**doc, "files": [1]}, "AttributeError: 'list' object has no attribute 'items'"),
    (lambda doc: {**doc, "files": {name: ["a", 1, 2, "x"] for name in doc["files"]}}, "invalid literal for int()"),
    (lambda doc: [1, 2], "TypeError"),
])
def test_a_digests_index_of_wrong_types_is_refused_without_a_traceback(saved, tmp_path, capsys, change, text):
    root, step = _copy(saved, tmp_path)
    _index(step, change)
    with pytest.raises(GefenCheckpointError, match=re.escape(text)):
        resume(root)
    assert cli.main(["verify", str(step)]) == cli.BAD
    err = capsys.readouterr()
    assert text in err.out and "FAILED" in err.out and "Traceback" not in err.out + err.err
    out = tmp_path / "out.pt"
    assert cli.main(["export", str(step), str(out)]) == cli.BAD
    err = capsys.readouterr().err
    assert text in err and err.startswith("error: ") and not out.exists()
