"""The errors of a checkpoint that cannot be saved or loaded, how every rank raises them,
and the advice they give.

A rank that raised alone would leave the others hanging in their next
collective, so every verdict that can differ between ranks goes through
``refuse_on_any_rank``: all ranks raise the same ``GefenCheckpointError``
together, and
nothing has been changed when they do. A load agrees once per phase
(``Verdict``), not once per check.

The advice a refusal gives (the step to fall back to, ``ckpt convert`` for
another optimizer, the settings for another model) is worded here and only
here (``fall_back``, ``convert_advice``, ``other_model_advice``,
``not_a_checkpoint``): a refusal composes these instead of repeating them.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable

from gefen_titan.distributed import raise_on_any_rank
from gefen_titan.errors import UserError

__all__ = ["CONVERT_TARGETS", "GefenCheckpointError", "Verdict", "convert_advice", "fall_back", "no_such_step",
           "not_a_checkpoint", "older_steps", "other_model_advice", "refuse_on_any_rank", "restore_advice",
           "root_cause", "saved_steps", "StepCheck", "unreadable"]

METADATA_FILE = ".metadata"  # DCP's index of a checkpoint folder, the last file a save writes


class GefenCheckpointError(UserError, RuntimeError):
    """A Gefen checkpoint that cannot be loaded into (or saved from) the live optimizer."""

    check: str | None = None  # the name in load_checks.CHECKS of the check that refused, where a subclass has one


def root_cause(error: Exception) -> str:
    """The innermost ``XError: message`` line of an exception (DCP's
    CheckpointException wraps per-rank tracebacks)."""
    causes = re.findall(r"^\s*([\w.]+(?:Error|Exception): .+)$", str(error), re.M)
    cause = causes[-1] if causes else f"{type(error).__name__}: {str(error).strip()[:200]}"
    return cause[:300]


def saved_steps(folder: str) -> list[int]:
    """The steps of the ``step-N`` folders in the local ``folder`` that hold a ``.metadata`` (torchtitan's
    test of a finished save), ascending; none for a folder that is not there."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(n[5:]) for n in os.listdir(folder) if re.fullmatch(r"step-\d+", n)
                  and os.path.isfile(os.path.join(folder, n, METADATA_FILE)))


def no_such_step(folder: str, step: int) -> str:
    """Why ``--checkpoint.load_step step`` finds nothing in ``folder``, with the steps that are there."""
    steps = saved_steps(folder)
    there = (f"the steps there: {', '.join(map(str, steps))}" if steps else f"no checkpoint in {folder}")
    return f"--checkpoint.load_step {step}: there is no checkpoint {os.path.join(folder, f'step-{step}')} ({there})"


def older_steps(checkpoint_id: str) -> list[int]:
    """Steps of the sibling ``step-N`` folders older than this one that hold a ``.metadata``,
    newest first (local folders only).

    An error message names the step to resume from; listing a remote
    folder is not worth a round trip there, so URLs get none.
    """
    path = str(checkpoint_id).rstrip("/")
    parent, here = os.path.split(path)
    m = re.fullmatch(r"step-(\d+)", here)
    if "://" in path or not m:
        return []
    return sorted((s for s in saved_steps(parent) if s < int(m.group(1))), reverse=True)


StepCheck = Callable[[str], "str | None"]
"""A step folder -> why it would not load (None: it checks out). ``digests.step_problem`` is the one
the package passes; this module cannot import it (``digests`` words its refusals with ``fall_back``)."""

MAX_FALL_BACK_CHECKS = 10
"""Older steps ``fall_back`` checks at most, newest first: torchtitan keeps 10 by default
(``checkpoint.keep_latest_k``), and each check reads a step's index and ``.metadata``."""

_checked = threading.local()  # .seen: folder -> check's verdict, within one outermost fall_back


def fall_back(checkpoint_id: str, check: StepCheck | None) -> str:
    """What to load instead of a checkpoint refused for its bytes: the newest older step that ``check``
    passes, by number (``check`` None: the newest older step, unchecked).

    A check may itself refuse a damaged older step, and word that refusal
    with ``fall_back`` for the steps older still: within one outermost call
    each folder is checked once, so the nesting costs no more reads.
    """
    older = older_steps(checkpoint_id)[:MAX_FALL_BACK_CHECKS]
    if check is None:
        if older:
            return f"resume from the newest older step with --checkpoint.load_step {older[0]}"
        return "resume from another checkpoint (none older is beside it: --checkpoint.initial_load_path PATH)"
    outermost = getattr(_checked, "seen", None) is None
    if outermost:
        _checked.seen = {}
    try:
        parent = os.path.dirname(str(checkpoint_id).rstrip("/"))
        damaged = []
        for step in older:
            folder = os.path.join(parent, f"step-{step}")
            if folder not in _checked.seen:
                try:
                    _checked.seen[folder] = check(folder)
                except Exception as e:  # a check that cannot tell: the step is not offered
                    _checked.seen[folder] = f"{type(e).__name__}: {e}"
            if _checked.seen[folder] is None:
                return (f"resume from step {step}, the newest older step whose files check out, with "
                        f"--checkpoint.load_step {step}")
            damaged.append(step)
    finally:
        if outermost:
            _checked.seen = None
    if damaged:
        return (f"resume from another checkpoint (the older steps beside it, {', '.join(map(str, damaged))}, "
                "do not check out either: --checkpoint.initial_load_path PATH)")
    return "resume from another checkpoint (none older is beside it: --checkpoint.initial_load_path PATH)"


def restore_advice(checkpoint_id: str, file: str | None, check: StepCheck | None) -> str:
    """What ``ckpt verify`` advises for a checkpoint it failed: restore the first bad file, or fall back."""
    what = f"restore {file} from a copy of this checkpoint" if file else "restore this checkpoint from a copy"
    return f"{what}, or {fall_back(checkpoint_id, check)} (`gefen-titan ckpt verify` it first). Nothing was changed."


def not_a_checkpoint(path: str) -> str | None:
    """Why the local folder ``path`` is not a checkpoint at all (None: it may be one, or is remote)."""
    if "://" in str(path) or os.path.isfile(os.path.join(path, METADATA_FILE)):
        return None
    if not os.path.isdir(path):
        return f"{path} does not exist" if not os.path.exists(path) else f"{path} is a file, not a checkpoint folder"
    steps = saved_steps(path)
    if steps:
        return (f"{path} is a folder of checkpoints, not a checkpoint: point at one of its step folders, "
                f"e.g. {os.path.join(path, f'step-{steps[-1]}')} (steps here: {', '.join(map(str, steps))})")
    return (f"{path} is not a checkpoint: it has no {METADATA_FILE} (DCP's index, the last file every save "
            "writes). Point at a checkpoint's step-N folder, one that holds a .metadata")


# ``gefen-titan ckpt convert --to`` values: the optimizer names, lower-cased, whose states it converts between
# (ckpt_tools.convert takes them from here, so the advice names only what the tool does).
CONVERT_TARGETS = ("adamw", "gefen")


def convert_advice(checkpoint_id: str, was: str, now: str) -> str | None:
    """``gefen-titan ckpt convert`` when a checkpoint of one of ``CONVERT_TARGETS``' optimizers is loaded as the
    other (None for another pair: convert handles only those two)."""
    if {was.lower(), now.lower()} != set(CONVERT_TARGETS):
        return None
    # Into a new run's checkpoint folder, resumed as a whole: an initial_load_path
    # would load its model only (torchtitan's initial_load_model_only default).
    step = os.path.basename(os.path.normpath(str(checkpoint_id)))
    return (f"convert it with `gefen-titan ckpt convert {checkpoint_id} NEW_RUN/checkpoint/{step} --to {now.lower()}` "
            "and resume that with --job.dump_folder NEW_RUN")


def other_model_advice(what: str) -> str:
    """What to do about a checkpoint written for another model (``what``: its shapes or names)."""
    return (f"the checkpoint was written for another model: {what}. Train with the flavor it was written "
            "for (--model.flavor), or load only its weights into this model if they fit "
            "(--checkpoint.initial_load_model_only), or leave the mismatched part out "
            "(checkpoint.exclude_from_loading = [\"optimizer\"] starts the optimizer fresh)")


def unreadable(checkpoint_id: str, error: Exception, check: StepCheck | None) -> GefenCheckpointError:
    what = not_a_checkpoint(checkpoint_id)
    if what is not None:
        return GefenCheckpointError(f"{what}. Nothing was loaded.")
    return GefenCheckpointError(
        f"cannot read checkpoint {checkpoint_id} ({root_cause(error)}): a file is "
        f"missing, truncated or unreadable. Restore it, or {fall_back(checkpoint_id, check)}. "
        "Nothing was loaded into the optimizer."
    )


def refuse_on_any_rank(error: str | None, what: str) -> None:
    """Raise ``GefenCheckpointError(f"{what}: {error}")`` on every rank if any rank has an error."""
    raise_on_any_rank(error, what, GefenCheckpointError)


class Verdict:
    """One load phase's refusal on this rank, agreed on every rank once (``settle``).

    A phase is what a load checks between two of its collectives (the small
    read of the records, DCP's read): those checks are local, so they note
    what they refuse here instead of each agreeing on its own, and every
    rank meets once at ``settle`` (one all-reduce when nothing failed). A
    rank that noted a refusal skips the rest of the phase's checks
    (``ok``): a later check may assume an earlier one passed, and the first
    refusal is the one its message must name.
    """

    def __init__(self) -> None:
        self.errors: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.errors

    def refuse(self, error: str | None) -> None:
        """Note why this rank refuses (None: nothing to refuse)."""
        if error:
            self.errors.append(error)

    def settle(self, what: str) -> None:
        """Collective: raise ``GefenCheckpointError(f"{what}: ...")`` on every rank if any rank refused."""
        refuse_on_any_rank("; ".join(self.errors) or None, what)
