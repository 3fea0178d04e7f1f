"""The errors of a checkpoint that cannot be saved or loaded, and how every rank raises them.

A rank that raised alone would leave the others hanging in their next
collective, so every verdict that can differ between ranks goes through
``refuse_on_any_rank``: all ranks raise the same ``GefenCheckpointError``
together, and
nothing has been changed when they do. A load agrees once per phase
(``Verdict``), not once per check.
"""

from __future__ import annotations

import re

from gefen_titan.distributed import raise_on_any_rank
from gefen_titan.errors import UserError

__all__ = ["GefenCheckpointError", "Verdict", "refuse_on_any_rank", "root_cause", "unreadable"]


class GefenCheckpointError(UserError, RuntimeError):
    """A Gefen checkpoint that cannot be loaded into (or saved from) the live optimizer."""


def root_cause(error: Exception) -> str:
    """The innermost ``XError: message`` line of an exception (DCP's
    CheckpointException wraps per-rank tracebacks)."""
    causes = re.findall(r"^\s*([\w.]+(?:Error|Exception): .+)$", str(error), re.M)
    cause = causes[-1] if causes else f"{type(error).__name__}: {str(error).strip()[:200]}"
    return cause[:300]


def unreadable(checkpoint_id: str, error: Exception) -> GefenCheckpointError:
    return GefenCheckpointError(
        f"cannot read checkpoint {checkpoint_id} ({root_cause(error)}): a file is "
        "missing, truncated or unreadable. Restore it, or resume from another step with "
        "checkpoint.load_step. Nothing was loaded into the optimizer."
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
