"""torchft's HTTP checkpoint transport, read without running code.

torchft 0.2.0's ``HTTPTransport`` unpickles what a peer sends with
``weights_only=False`` (its LR scheduler state may hold objects): a heal
could run code from another machine. gefen-titan's heal payload holds only
tensors and plain data (``optim.live_state``, ``ft.heal``), so the joiner
reads it with ``weights_only=True``: a payload with any other global is
refused, naming it. The transport also keeps what the last send and receive
moved, for the heal's log line and ``scripts/bench_heal.py``.

``_load_from_address`` and ``_streaming_load`` are torchft internals
(pinned: ``torchft==0.2.0``, ``tests/unit/test_contract_torchft.py``).
"""

from __future__ import annotations

import time
import urllib.request
from datetime import timedelta
from typing import Any

from torchft.checkpointing import HTTPTransport
from torchft.checkpointing._serialization import _streaming_load

from gefen_titan.optim.live_state import payload_bytes

__all__ = ["SafeHTTPTransport"]


class SafeHTTPTransport(HTTPTransport):
    """``HTTPTransport`` whose receiving side unpickles with ``weights_only=True``."""

    def __init__(self, timeout: timedelta, num_chunks: int = 0) -> None:
        super().__init__(timeout=timeout, num_chunks=num_chunks)
        self.last_sent_bytes = 0
        self.last_received_bytes = 0
        self.last_receive_seconds = 0.0

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        self.last_sent_bytes = payload_bytes(state_dict)
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        begin = time.perf_counter()
        out = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.last_receive_seconds = time.perf_counter() - begin
        self.last_received_bytes = payload_bytes(out)
        return out
