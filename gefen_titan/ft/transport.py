"""torchft's HTTP checkpoint transport, read without running code.

torchft 0.2.0's ``HTTPTransport`` unpickles what a peer sends with
``weights_only=False`` (its LR scheduler state may hold objects): a heal
could run code from another machine. gefen-titan's heal payload holds only
tensors and plain data (``optim.live_state``, ``ft.heal``), so the joiner
reads it with ``weights_only=True``: a payload with any other global is
refused, naming it. The transport also keeps what the last send and receive
moved, for the heal's log line and ``scripts/bench_heal.py``.

**Keyed heals.** With ``[checkpoint] digest_key_env`` set (``key``, set by
``GefenFTCheckpointManager``), the sender signs what it serves: a keyed
BLAKE2b-128 (``heal_mac``) over the step it serves and every tensor's
dtype, shape and bytes and every plain value of the payload, in a canonical
order. The joiner recomputes it for the step its quorum asked for before
anything is copied, and refuses (``HealRefused``) a payload without a MAC,
with another one (changed in flight, from a process without the key, or
signed for another step: an older heal replayed). The refusal is raised on
torchft's quorum thread, inside ``recv_checkpoint``: torchft reports it as
the step's error, the step does not commit, nothing is applied, and the
next quorum heals the group again (from the peer the lighthouse names
then). Cost, with a key only: one keyed pass over the payload on each side
(~1 GB/s a core). Without a key a heal is trusted as it comes from whoever
answers on the replica group's port (``docs/fault_tolerance.md``).

A peer that dies mid-transfer ends the stream early: the joiner's read
raises (``_Exact``), torchft reports it, nothing is applied, and the next
quorum heals again.

``_load_from_address`` and ``_streaming_load`` are torchft internals
(pinned: ``torchft==0.2.0``, ``tests/unit/test_contract_torchft.py``).
"""

from __future__ import annotations

import hashlib
import time
import urllib.request
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing import HTTPTransport
from torchft.checkpointing._serialization import _streaming_load

from gefen_titan.optim.live_state import payload_bytes

__all__ = ["SafeHTTPTransport", "HealRefused", "heal_mac", "MAC_FIELD"]

MAC_FIELD = "gefen_titan_mac"  # beside torchft's "user" and "torchft" parts of the payload


class HealRefused(RuntimeError):
    """A heal payload whose MAC is missing or wrong: nothing of it was applied."""


def heal_mac(step: int, payload: Any, key: bytes) -> str:
    """The keyed MAC of a heal payload served for ``step`` (module docstring)."""
    h = hashlib.blake2b(key=key, digest_size=16)
    h.update(f"gefen-titan heal step {int(step)};".encode())
    _feed(h, payload)
    return h.hexdigest()


def _feed(h: Any, v: Any) -> None:
    # Every value tagged with its type and length: no two payloads feed the same bytes.
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(v, dict):
        h.update(f"D{len(v)};".encode())
        for k in sorted(v, key=repr):
            _feed(h, k)
            _feed(h, v[k])
    elif isinstance(v, (list, tuple)):
        h.update(f"{type(v).__name__[0]}{len(v)};".encode())
        for x in v:
            _feed(h, x)
    elif isinstance(v, (bytes, bytearray)):
        h.update(f"B{len(v)};".encode())
        h.update(v)
    elif v is None or isinstance(v, (bool, int, float, str)):
        r = repr(v).encode()
        h.update(f"{type(v).__name__}{len(r)};".encode())
        h.update(r)
    else:  # a weights_only payload holds nothing else
        raise TypeError(f"a heal payload holds a {type(v).__name__}, which cannot be signed")


class _Exact:
    """A heal's HTTP stream that raises when it ends early. torchft's server streams without a
    length, so a peer that dies mid-transfer looks like an early end: every read must return what
    it asked for (the records' lengths come first), else the heal is dropped with a message
    that says so, not an EOFError or a buffer error from deep inside the decoder."""

    def __init__(self, f: Any, address: str) -> None:
        self._f, self._address, self._got = f, address, 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._got += len(data)
        if n is not None and n > 0 and len(data) < n:
            raise ConnectionError(
                f"heal from {self._address}: the peer's stream ended after {self._got:,} bytes, {n - len(data):,} "
                "short (the serving peer died mid-transfer?): nothing of it was applied; torchft retries the heal "
                "at the next quorum")
        return data

    def readline(self, *args: Any) -> bytes:
        line = self._f.readline(*args)
        self._got += len(line)
        return line


class SafeHTTPTransport(HTTPTransport):
    """``HTTPTransport`` whose receiving side unpickles with ``weights_only=True``."""

    def __init__(self, timeout: timedelta, num_chunks: int = 0, key: bytes | None = None) -> None:
        super().__init__(timeout=timeout, num_chunks=num_chunks)
        self.key = key  # sign what is sent and check what is received (module docstring)
        self.last_sent_bytes = 0
        self.last_received_bytes = 0
        self.last_receive_seconds = 0.0

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(_Exact(f, address), weights_only=True)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        self.last_sent_bytes = payload_bytes(state_dict)
        if self.key is not None:
            state_dict = {**state_dict, MAC_FIELD: heal_mac(step, state_dict, self.key)}
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        begin = time.perf_counter()
        out = super().recv_checkpoint(src_rank, metadata, step, timeout)
        mac = out.pop(MAC_FIELD, None) if isinstance(out, dict) else None
        if self.key is not None:
            why = ("carries no MAC (the sender holds no key: checkpoint.digest_key_env unset there?)" if mac is None
                   else "its MAC does not match (changed in flight, signed with another key, or for another step)"
                   if mac != heal_mac(step, out, self.key) else None)
            if why:
                raise HealRefused(f"heal payload for step {step} from replica rank {src_rank} {why}: refused before "
                                  "anything was applied; torchft retries the heal at the next quorum")
        self.last_receive_seconds = time.perf_counter() - begin
        self.last_received_bytes = payload_bytes(out)
        return out
