"""Progress bars for long work: validate's runs, the ckpt tools' reads of a checkpoint, the scale plan.

tqdm's (a dependency of datasets and huggingface-hub already; declared in
pyproject), on stderr and only where stderr is a terminal: a log file, CI or
a test's captured output gets no bar and no control characters. While a bar
is shown, each line the work prints to stdout clears the bar first and
redraws it after (``_AboveBar``), so the lines land above it instead of
through it. (tqdm's ``DummyTqdmFile`` does not: under ``redirect_stdout``
its ``tqdm.write`` no longer takes the real stdout for a terminal stream and
leaves a bar on stderr uncleared, the line glued to it.)
Here, below every layer that shows one, since ``validation`` and
``ckpt_tools`` may not import each other.

``reading`` is a bar in bytes over everything the checkpoint readers read
inside it: ``checkpoint.io.item_reads`` calls ``advance`` after each item it
has read and checked (a no-op outside ``reading``), so a tool shows its
progress without threading a callback through DCP's load.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["advance", "bar", "reading"]

_reading: ContextVar[Any] = ContextVar("gefen_titan_reading_bar", default=None)


class _AboveBar(io.TextIOBase):
    """stdout while a bar is shown: each complete line is written with the bar cleared, then the bar redrawn."""

    def __init__(self, out: TextIO, shown: Any) -> None:
        super().__init__()
        self._out, self._bar, self._buf = out, shown, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buf += text
        if "\n" in self._buf:
            lines, _, self._buf = self._buf.rpartition("\n")
            self._bar.clear()
            self._out.write(lines + "\n")
            self._out.flush()
            self._bar.refresh()
        return len(text)

    def flush(self) -> None:
        if self._buf:
            self._bar.clear()
            self._out.write(self._buf)
            self._buf = ""
        self._out.flush()


@contextlib.contextmanager
def bar(total: int | None, desc: str, *, unit: str = "it", unit_scale: bool = False,
        file: TextIO | None = None) -> Iterator[Any]:
    """A tqdm bar of ``total`` steps on ``file`` (default stderr), disabled where that is no terminal;
    ``update(n)`` it as the work goes. stdout is routed above it while it is shown."""
    out = file if file is not None else sys.stderr
    shown = bool(getattr(out, "isatty", lambda: False)())
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=out, disable=not shown,
              dynamic_ncols=True, leave=False) as t:
        if not shown:
            yield t
            return
        above = _AboveBar(sys.stdout, t)
        try:
            with contextlib.redirect_stdout(above):
                yield t
        finally:
            above.flush()


@contextlib.contextmanager
def reading(total_bytes: int, desc: str, *, file: TextIO | None = None) -> Iterator[Any]:
    """A bar of ``total_bytes`` that every checkpoint read inside it advances (``advance``)."""
    with bar(total_bytes, desc, unit="B", unit_scale=True, file=file) as t:
        token = _reading.set(t)
        try:
            yield t
        finally:
            _reading.reset(token)


def advance(n: int) -> None:
    """``n`` more bytes read, on the ``reading`` bar if one is open (else nothing)."""
    t = _reading.get()
    if t is not None:
        t.update(n)
