"""What a run is about to load, looked at before anything is built (checkpoint.preflight),
and the advice of a checkpoint refusal (checkpoint.errors)."""

import pytest

from gefen_titan.checkpoint import preflight
from gefen_titan.checkpoint.errors import (
    GefenCheckpointError,
    convert_advice,
    fall_back,
    not_a_checkpoint,
    unreadable,
)


def step(folder, n, metadata=True):
    d = folder / f"step-{n}"
    d.mkdir(parents=True)
    if metadata:
        (d / ".metadata").write_bytes(b"x")
    return d


def check(folder, steps, load_step=-1, initial=None, model_only=True, enable=True):
    return preflight.before_build(enable=enable, folder=str(folder), load_step=load_step, initial_load_path=initial,
                                  initial_load_model_only=model_only, from_hf=False, steps=steps)


@pytest.mark.parametrize("steps", [4, 2])
def test_a_checkpoint_at_or_past_the_last_step_says_so_and_how_to_continue(tmp_path, steps):
    step(tmp_path, 2)
    step(tmp_path, 4)
    step(tmp_path, 6, metadata=False)  # an unfinished save: torchtitan skips it too
    msg = check(tmp_path, steps)
    assert msg is not None and "at step 4" in msg and f"--training.steps is {steps}" in msg
    assert "raise --training.steps above 4" in msg


def test_something_left_to_train_passes(tmp_path):
    step(tmp_path, 4)
    assert check(tmp_path, 5) is None
    assert check(tmp_path, 5, load_step=4) is None
    assert check(tmp_path, 2, enable=False) is None
    step(tmp_path / "seed", 0)
    assert check(tmp_path / "seed", 0) is None  # a seed checkpoint is a start


def test_explicit_load_step_is_the_one_checked(tmp_path):
    step(tmp_path, 4)
    step(tmp_path, 8)
    assert check(tmp_path, 6, load_step=4) is None
    assert "at step 8" in check(tmp_path, 6)


def test_a_load_step_with_no_checkpoint_names_the_steps_there(tmp_path):
    step(tmp_path, 4)
    step(tmp_path, 8)
    step(tmp_path, 6, metadata=False)
    for missing in (2, 6):
        with pytest.raises(GefenCheckpointError, match=rf"load_step {missing}: there is no checkpoint "
                                                       rf".*step-{missing} \(the steps there: 4, 8\)"):
            check(tmp_path, 10, load_step=missing)
    with pytest.raises(GefenCheckpointError, match="no checkpoint in"):
        check(tmp_path / "none", 10, load_step=3)


def test_initial_load_path_not_a_checkpoint_is_refused_before_anything(tmp_path):
    ckpts = tmp_path / "run" / "checkpoint"
    step(ckpts, 3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(GefenCheckpointError, match=r"empty is not a checkpoint: it has no \.metadata"):
        check(tmp_path / "none", 10, initial=str(tmp_path / "empty"))
    with pytest.raises(GefenCheckpointError, match=r"a folder of checkpoints.*step-3 \(steps here: 3\)"):
        check(tmp_path / "none", 10, initial=str(ckpts))
    with pytest.raises(GefenCheckpointError, match="does not exist"):
        check(tmp_path / "none", 10, initial=str(tmp_path / "missing"))
    assert check(tmp_path / "none", 10, initial=str(ckpts / "step-3")) is None
    # the whole state (not model only) at its folder's step: nothing left either
    assert "at step 3" in check(tmp_path / "none", 3, initial=str(ckpts / "step-3"), model_only=False)


def test_fall_back_names_the_newest_older_step(tmp_path):
    step(tmp_path, 2)
    step(tmp_path, 5)
    step(tmp_path, 7, metadata=False)
    here = step(tmp_path, 9)
    assert fall_back(str(here), None).endswith("--checkpoint.load_step 5")
    assert "--checkpoint.load_step" not in fall_back(str(tmp_path / "step-2"), None)
    assert "--checkpoint.load_step 5" in str(unreadable(str(here), OSError("short read"), None))


def test_unreadable_folder_that_is_no_checkpoint_says_so(tmp_path):
    msg = str(unreadable(str(tmp_path), FileNotFoundError("no .metadata"), None))
    assert "is not a checkpoint: it has no .metadata" in msg and "missing, truncated" not in msg
    assert not_a_checkpoint(str(step(tmp_path, 1))) is None


def test_convert_advice_only_between_gefen_and_adamw():
    advice = convert_advice("/r/checkpoint/step-4", "Gefen", "AdamW")
    assert "ckpt convert /r/checkpoint/step-4 NEW_RUN/checkpoint/step-4 --to adamw" in advice
    assert "--job.dump_folder NEW_RUN" in advice
    assert "--to gefen" in convert_advice("c", "AdamW", "Gefen")
    assert convert_advice("c", "GefenMuon", "AdamW") is None


def test_verify_advises_in_the_load_refusals_words(tmp_path):
    """``ckpt verify``'s advice is worded by checkpoint.errors (one module words the advice): restore the
    first bad file, or the newest older step beside it, by number (issue 49)."""
    from gefen_titan.checkpoint.errors import fall_back, restore_advice

    for step in (2, 5, 7):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    advice = restore_advice(str(tmp_path / "step-7"), "__0_0.distcp", None)
    assert advice.startswith("restore __0_0.distcp from a copy of this checkpoint, or ")
    assert fall_back(str(tmp_path / "step-7"), None) in advice and "--checkpoint.load_step 5" in advice
    assert "another checkpoint (none older" in restore_advice(str(tmp_path / "step-2"), None, None)
