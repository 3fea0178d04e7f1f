"""The step a refusal offers instead (issue 49): the newest older step whose files check out
(``digests.step_problem``: index, ``.metadata``, every data file's size), by number, not merely the
newest older folder."""

import os
import shutil

import pytest

from gefen_titan.checkpoint.errors import GefenCheckpointError, fall_back, restore_advice
from gefen_titan.checkpoint.format import digests
from tests.helpers import tiny_checkpoint


@pytest.fixture
def steps(tmp_path):
    """step-1..step-7 of one run (copies of one tiny checkpoint), step-7 the one refused."""
    first = tiny_checkpoint.save(tmp_path)
    for n in (3, 5, 7):
        shutil.copytree(first, first.parent / f"step-{n}")
    return first.parent


def data_file(step):
    return next(p for p in sorted(step.iterdir()) if p.name.endswith(".distcp"))


def truncate(path, by=3):
    path.write_bytes(path.read_bytes()[:-by])


def flip(path, at=40):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_whole_step_checks_out(steps):
    for n in (1, 3, 5, 7):
        assert digests.step_problem(str(steps / f"step-{n}")) is None


def test_each_kind_of_damage_is_found_without_reading_the_data(steps):
    truncate(data_file(steps / "step-5"))
    assert "bytes, its save wrote" in digests.step_problem(str(steps / "step-5"))
    os.remove(data_file(steps / "step-3"))
    assert "is missing" in digests.step_problem(str(steps / "step-3"))
    flip(steps / "step-1" / ".metadata")
    assert "digest" in digests.step_problem(str(steps / "step-1"))
    flip(steps / "step-7" / ".digests", at=5)
    assert digests.step_problem(str(steps / "step-7")) is not None
    os.remove(steps / "step-7" / ".metadata")
    assert "no .metadata" in digests.step_problem(str(steps / "step-7"))


def test_the_offer_skips_older_steps_that_do_not_check_out(steps):
    truncate(data_file(steps / "step-5"))
    flip(steps / "step-3" / ".metadata")
    advice = fall_back(str(steps / "step-7"), digests.step_problem)
    assert advice.endswith("--checkpoint.load_step 1"), advice
    assert "step 1, the newest older step whose files check out" in advice
    # unchecked, the newest older folder would be offered: the damaged step 5
    assert fall_back(str(steps / "step-7"), None).endswith("--checkpoint.load_step 5")
    truncate(data_file(steps / "step-1"))
    advice = restore_advice(str(steps / "step-7"), "__0_0.distcp", digests.step_problem)
    assert "older steps beside it, 5, 3, 1, do not check out either" in advice, advice
    assert "--checkpoint.load_step" not in advice


def test_a_step_saved_without_digests_is_offered(steps):
    truncate(data_file(steps / "step-5"))
    os.remove(steps / "step-3" / ".digests")  # an older save: nothing to check it against
    assert fall_back(str(steps / "step-7"), digests.step_problem).endswith("--checkpoint.load_step 3")


def test_each_older_step_is_checked_once(steps, monkeypatch):
    """A damaged older step's own refusal offers the steps older still: the nesting reuses the checks."""
    for n in (5, 3):
        flip(steps / f"step-{n}" / ".digests", at=5)
    calls = []
    check = digests.step_problem

    def counted(folder):
        calls.append(os.path.basename(folder))
        return check(folder)

    monkeypatch.setattr(digests, "step_problem", counted)  # the refusals' own advice calls it too
    assert fall_back(str(steps / "step-7"), counted).endswith("--checkpoint.load_step 1")
    assert sorted(calls) == ["step-1", "step-3", "step-5"], calls


def test_the_load_refusal_offers_the_step_that_checks_out(tmp_path):
    """End to end: a truncated data file at the newest step, the step before it damaged too."""
    first = tiny_checkpoint.save(tmp_path)
    for n in (2, 3):
        shutil.copytree(first, first.parent / f"step-{n}")
    truncate(data_file(first.parent / "step-3"))
    truncate(data_file(first.parent / "step-2"))
    with pytest.raises(GefenCheckpointError) as refused:
        tiny_checkpoint.resume(tmp_path, step=3)
    assert "--checkpoint.load_step 1" in str(refused.value), str(refused.value)
    assert "--checkpoint.load_step 2" not in str(refused.value)


def test_a_refusal_unpickled_on_another_rank_keeps_its_advice_without_checking_again(steps, monkeypatch):
    """DCP gathers a refusal to every rank by pickling it: the advice travels as worded, and no rank that
    unpickles it reads the older steps again."""
    import pickle

    from gefen_titan.checkpoint.checks.metadata_fields import MalformedMetadataError

    truncate(data_file(steps / "step-5"))
    calls = []
    check = digests.step_problem
    monkeypatch.setattr(digests, "step_problem", lambda folder: calls.append(folder) or check(folder))
    error = MalformedMetadataError(str(steps / "step-7"), "storage_data is list, not a dict")
    assert str(error).endswith("--checkpoint.load_step 3. Nothing was loaded."), str(error)
    seen = len(calls)
    back = pickle.loads(pickle.dumps(error))
    assert str(back) == str(error) and back.what == error.what and len(calls) == seen
