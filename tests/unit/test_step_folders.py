"""Odd step folder names (issue 50, item 2: ``checkpoint.manager.step_folders``): a name that is no
``step-N`` as torchtitan writes it, a step beyond 2^53, or a file named like a step folder is ignored by
the resume's choice of the step (and by the purge), with one warning naming it, not a traceback and not
a refused resume. One process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gefen_titan.checkpoint.manager import step_folders
from gefen_titan.optim import gefenx as gx
from tests.helpers.tiny_checkpoint import STEP, build, manager, save

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")

ODD = {
    "step-10e5": "its step is no decimal number",  # torchtitan's search took it for step 10: FileNotFoundError
    "step-abc": "its step is no decimal number",
    "step-": "its step is no decimal number",
    "step-007": "its step is no decimal number",  # its step binding would name step 7
    "step-99999999999999999999999": "its step is beyond 9,007,199,254,740,992 (2^53)",  # every resume refused
    "step-9007199254740993": "its step is beyond 9,007,199,254,740,992 (2^53)",
    "step-70": "it is no folder",  # a file
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    save(root)
    return root


def _with_odd_names(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    step = root / "ckpt" / f"step-{STEP}"
    for name in ODD:
        if name == "step-70":
            (root / "ckpt" / name).write_text("not a checkpoint")
        else:
            shutil.copytree(step, root / "ckpt" / name)  # each a whole checkpoint (of step 1)
    return root


def test_odd_names_are_ignored_with_one_warning_each_and_the_resume_takes_the_newest_step(saved, tmp_path, caplog):
    root = _with_odd_names(saved, tmp_path)
    net, opt = build(5)
    with caplog.at_level("WARNING"):
        assert manager(root, net, opt).load()
    assert all(gx.global_step(o) == STEP for o in opt.optimizers)  # step-1, the one well-named folder
    for name, why in ODD.items():
        lines = [r.getMessage() for r in caplog.records if f"ignoring {name!r}: " in r.getMessage()]
        assert len(lines) == 1 and why in lines[0], (name, lines)


def test_the_well_named_steps(saved, tmp_path):
    root = _with_odd_names(saved, tmp_path)
    shutil.copytree(root / "ckpt" / f"step-{STEP}", root / "ckpt" / "step-0")
    shutil.copytree(root / "ckpt" / f"step-{STEP}", root / "ckpt" / f"step-{1 << 53}")  # the bound itself
    assert step_folders(str(root / "ckpt")) == {0: "step-0", STEP: f"step-{STEP}", 1 << 53: f"step-{1 << 53}"}


def test_the_purge_deletes_no_odd_name(saved, tmp_path):
    """keep_latest_k = 2 after saves at steps 2 and 3: step-1 goes, the odd names stay (torchtitan's search
    would count the file step-70 and the folder step-10e5 as steps 70 and 10, and delete them)."""
    root = _with_odd_names(saved, tmp_path)
    for step in (2, 3):
        shutil.copytree(root / "ckpt" / f"step-{STEP}", root / "ckpt" / f"step-{step}")
    net, opt = build(5)
    m = manager(root, net, opt, keep_latest_k=2)
    m._should_purge = lambda: True  # torchtitan's asks rank 0 of a process group: one process here
    m._purge_stale_checkpoints()
    m.close()  # waits for the purge thread
    left = {p.name for p in (root / "ckpt").iterdir()}
    assert left == set(ODD) | {"step-2", "step-3"}, left
