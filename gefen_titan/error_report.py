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
* exit status 1, with no traceback.

``GEFEN_TITAN_TRACEBACK=1`` re-raises instead (every rank's traceback, as
before). Every other exception is left alone: the entry point's ``@record``
writes its traceback to the error file, as torchrun expects.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

from gefen_titan.errors import UserError

__all__ = ["TRACEBACK_ENV", "format_block", "reported"]

TRACEBACK_ENV = "GEFEN_TITAN_TRACEBACK"
"""Set to 1 for the traceback of a user's error (on every rank)."""


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
    try:
        with open(path, "w") as f:
            json.dump(data, f)
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
        # Another rank's message reaches the user through its error file (torchrun's
        # summary); with no error file (another launcher) each rank prints its own.
        carried = write_error_file(block)
        if os.environ.get("RANK", "0") == "0" or not carried:
            print(block, file=sys.stderr, flush=True)
        # SystemExit, not an Exception: the entry point's ``@record`` re-raises
        # it as it is instead of overwriting the error file with a traceback.
        raise SystemExit(1) from None
