"""Peak resident memory of a code region, for the benchmarks.

``ru_maxrss`` is a process-lifetime high-water mark: a region that peaks
below an earlier peak (a save after training steps) reads as zero growth.
On Linux the kernel's own high-water mark (``VmHWM``) can be reset by
writing ``5`` to ``/proc/self/clear_refs``; ``PeakRSS`` does that on entry
and reads ``VmHWM`` on exit, so the figure is the region's own peak over the
resident size at its start, page-exact and with no sampling. Where the
reset is not allowed it falls back to sampling ``VmRSS`` every millisecond
from a thread (``method`` says which one measured).

On entry the heap that earlier work freed is handed back to the system
(``gc.collect()``, glibc's ``malloc_trim``): otherwise the region's
allocations reuse it without raising the resident size, and a whole-model
temporary could read as no growth.
"""

from __future__ import annotations

import ctypes
import gc
import re
import threading
import time

__all__ = ["PeakRSS", "current_rss"]

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    with open(_STATUS) as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    if match is None:
        raise OSError(f"{_STATUS} has no {field}")
    return int(match.group(1))


def current_rss() -> int:
    """Resident bytes of this process now."""
    return _status_kib("VmRSS") * 1024


def _trim_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """``with PeakRSS() as m: ...``; then ``m.growth`` (bytes), ``m.start``, ``m.peak``."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.start = self.peak = self.growth = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self) -> PeakRSS:
        _trim_heap()
        self.start = current_rss()
        if _reset_hwm():
            self.method = "VmHWM"
        else:
            self.method = "sampled"
            self._sampled = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled = max(self._sampled, current_rss())
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._sampled, current_rss())
        else:
            self.peak = _status_kib("VmHWM") * 1024
        self.growth = max(0, self.peak - self.start)
