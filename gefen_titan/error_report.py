"""How the entry point reports an error: a user's error as a short block, anything else as it was.

Under torchrun every rank raises the same ``UserError`` (recipe errors before
any process group exists, checkpoint refusals agreed on every rank), and a
traceback per rank plus torchrun's own summary buried its one useful line.
``reported`` turns a ``UserError`` into:

* one block on stderr, from rank 0 only (``format_block``): the message, which
  says what is wrong and what to do, and how to get the traceback (from every
  rank where there is no error file to carry the other ranks' messages: a
  launcher other than torchrun);
* torchelastic's error file (``TORCHELASTIC_ERROR_FILE``, the file
  ``torch.distributed.elastic.multiprocessing.errors.record`` writes), on
  every rank, holding the same block, so torchrun's "Root Cause" shows it
  whichever rank torchrun names, and a message only another rank raised is
  in torchrun's "Failures" list;
* exit status 1, with no traceback, at once on each node's local rank 0. The
  other ranks wait for torchrun to stop them (``LAGGARD_WAIT_S``) and leave
  with status 0 when it does: torchrun lists every rank that exited non-zero,
  the ones it stopped included, each with its error file, so with every rank
  failing the message was printed once per rank in its summary (49 lines of
  output on 2 ranks, 40 now). The job still fails (torchrun's status is its
  first failure's). A rank that torchrun does not stop in time (its node's
  first rank did not fail: a message only it raised) exits 1 after the wait,
  and its error file shows its message.

``GEFEN_TITAN_TRACEBACK=1`` re-raises instead (every rank's traceback, as
before). Every other exception is left alone: the entry point's ``@record``
writes its traceback to the error file, as torchrun expects.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator

from gefen_titan.errors import UserError

__all__ = ["TRACEBACK_ENV", "format_block", "reported"]

TRACEBACK_ENV = "GEFEN_TITAN_TRACEBACK"
"""Set to 1 for the traceback of a user's error (on every rank)."""

LAGGARD_WAIT_S = 20.0
"""How long a rank other than its node's first waits for torchrun to stop it. torchrun
polls its workers every 0.1 s by default (``--monitor-interval``) and stops the rest
with SIGTERM once one has failed; the wait only bounds the case where it does not
(its node's first rank did not fail), so it is generous rather than tight."""


def _stopped(signum, frame) -> None:
    """A laggard's SIGTERM handler: exit 0, the failure is its node's first rank's, already
    reported; no interpreter teardown, nothing of this failed run is worth it."""
    sys.stderr.flush()
    os._exit(0)


def format_block(error: UserError) -> str:
    """The lines a user sees for ``error``: its message as it is (a tyro error's own lines
    included) and the debug switch."""
    message = str(error).strip() or type(error).__name__
    return (f"gefen-titan: error: {message}\n"
            f"  ({type(error).__name__}; {TRACEBACK_ENV}=1 shows the traceback)")


def write_error_file(block: str) -> bool:
    """The block in torchelastic's error-file format (the one ``ErrorHandler.record_exception``
    writes), where torchrun asked for one; torchrun prints its ``py_callstack`` as the
    failure's "traceback" field. True if written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": {"message": block,
                        "extraInfo": {"py_callstack": block, "timestamp": str(int(time.time()))}}}
    # Whole or not at all (a rank stopped mid-write leaves no half file): written beside it, then renamed.
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """Report a ``UserError`` raised inside as a block and exit 1 (see the module's docstring)."""
    try:
        yield
    except UserError as e:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        block = format_block(e)
        # Not its node's first rank under torchrun: let torchrun see that one fail
        # alone and stop this one, so its summary shows the message once, under
        # "Root Cause". The handler goes in before the error file, which is what
        # tells a watcher (torchrun, a test) that this rank has failed.
        laggard = bool(os.environ.get("TORCHELASTIC_ERROR_FILE")) and os.environ.get("LOCAL_RANK", "0") != "0"
        if laggard:
            signal.signal(signal.SIGTERM, _stopped)
        # Another rank's message reaches the user through its error file (torchrun's
        # summary); with no error file (another launcher) each rank prints its own.
        carried = write_error_file(block)
        if os.environ.get("RANK", "0") == "0" or not carried:
            print(block, file=sys.stderr, flush=True)
        if laggard and carried:
            time.sleep(LAGGARD_WAIT_S)
        if laggard:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # SystemExit, not an Exception: the entry point's ``@record`` re-raises
        # it as it is instead of overwriting the error file with a traceback.
        raise SystemExit(1) from None
