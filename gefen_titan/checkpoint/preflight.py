"""What a run is about to load, looked at before anything is built.

torchtitan finds the checkpoint to load only inside ``Trainer.train``, after
the model, the optimizer, the data loader and the process group exist: a
folder that is not a checkpoint was refused only after all that (and its
advice, "a file is missing", was wrong for it), and a checkpoint whose step
already reaches ``--training.steps`` either ended the run with "Training
completed" and nothing else, or crashed in torchtitan's LR scheduler (a step
past the schedule's end: ``decay_steps must not be zero``).

``before_build`` repeats torchtitan's choice of what to load
(``CheckpointManager.load``: the newest ``step-N`` of the checkpoint folder
holding a ``.metadata``, or ``load_step``'s, else ``initial_load_path``) on
local folders only (a remote one is left to the load itself), and is
file reads only, no collective: every rank that sees the same files reaches
the same verdict.
"""

from __future__ import annotations

import os
import re

from gefen_titan.checkpoint.errors import GefenCheckpointError, no_such_step, not_a_checkpoint, saved_steps

__all__ = ["before_build", "nothing_to_train"]


def nothing_to_train(step: int, steps: int, where: str) -> str:
    """The message for a loaded step that already reaches ``training.steps``."""
    return (f"nothing to train: the checkpoint to load ({where}) is at step {step}, and --training.steps is "
            f"{steps}. To continue it, raise --training.steps above {step} (e.g. --training.steps {step + 10}); "
            "to start over, use another --job.dump_folder")


def before_build(*, enable: bool, folder: str, load_step: int, initial_load_path: str | None,
                 initial_load_model_only: bool, from_hf: bool, steps: int) -> str | None:
    """Check what the run will load; the "nothing to train" message when its step reaches
    ``steps`` (None: there is something to train, or nothing to look at here).

    Raises ``GefenCheckpointError`` for a ``load_step`` with no checkpoint, and for an
    ``initial_load_path`` that is not a checkpoint.
    """
    if not enable or "://" in folder:
        return None
    if load_step == -1:
        step = max(saved_steps(folder), default=None)
    elif load_step in saved_steps(folder):
        step = load_step
    else:  # torchtitan would fail in its load (FileNotFoundError, or DCP's read of no .metadata)
        raise GefenCheckpointError(f"{no_such_step(folder, load_step)}. Nothing was loaded.")
    if step is not None:
        where = os.path.join(folder, f"step-{step}")
        # step 0 is a seed checkpoint: model only, the run starts at step 1
        return nothing_to_train(step, steps, where) if 0 < step >= steps else None
    if initial_load_path and not from_hf:
        why = not_a_checkpoint(initial_load_path)
        if why is not None:
            raise GefenCheckpointError(f"--checkpoint.initial_load_path: {why}. Nothing was loaded.")
        m = re.fullmatch(r"step-(\d+)", os.path.basename(os.path.normpath(initial_load_path)))
        if m and not initial_load_model_only and 0 < int(m.group(1)) >= steps:
            return nothing_to_train(int(m.group(1)), steps, initial_load_path)
    return None
