"""A replica group's rank that serves one heal and dies part-way through the transfer.

``serve_and_die(cut, conn)``, the target of a forked process (no imports
to repeat), or ``python -m tests.helpers.dying_heal_server CUT``: stages a heal payload
(4 fp32 tensors of 256 x 256 and plain data, step 5) in a
``SafeHTTPTransport`` as torchft's live side does, prints the address the
joiner fetches it from, and SIGKILLs itself once ``CUT`` bytes of the
transfer have gone out (a real process death mid-transfer, not an
exception: the socket closes with the bytes sent so far).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torchft.checkpointing.http_transport as http_transport

from gefen_titan.ft.transport import SafeHTTPTransport


def payload() -> dict:
    g = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)}
    return {"user": {"gefen_titan": {"model": model, "train_state": {"step": 5}}}, "torchft": {"step": 5}}


class DyingStream:
    """A writer that SIGKILLs its own process once ``cut`` bytes have gone through it."""

    def __init__(self, f, cut: int) -> None:
        self._f, self._cut, self._sent = f, cut, 0

    def write(self, b) -> int:
        b = memoryview(b).cast("B")
        if self._sent + len(b) >= self._cut:
            self._f.write(b[:self._cut - self._sent])
            self._f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        self._sent += len(b)
        return self._f.write(b)

    def __getattr__(self, name):
        return getattr(self._f, name)


def serve_and_die(cut: int, conn=None) -> None:
    """Stage the payload, hand its address to ``conn`` (else print it), serve until killed."""
    save = http_transport._streaming_save  # what torchft's server streams the payload with
    http_transport._streaming_save = lambda obj, f, *a, **kw: save(obj, DyingStream(f, cut), *a, **kw)
    transport = SafeHTTPTransport(timedelta(seconds=30))
    transport.send_checkpoint([1], step=5, state_dict=payload(), timeout=timedelta(seconds=30))
    if conn is None:
        print(transport.metadata(), flush=True)
    else:
        conn.send(transport.metadata())
    time.sleep(60)  # until the joiner's request kills it


if __name__ == "__main__":
    serve_and_die(int(sys.argv[1]))
