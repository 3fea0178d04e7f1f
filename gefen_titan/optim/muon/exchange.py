"""One packed point-to-point exchange: per peer, one buffer each way.

A bucket's exchange moves, between each pair of ranks, every tensor of the
bucket that one sends the other (momentum shards, NorMuon rows, update
slices, of several dtypes), so each pair's tensors travel packed as one
uint8 buffer per direction, posted together with ``batch_isend_irecv``
(coalesced into one NCCL group; gloo posts them one by one, each
asynchronous). Point-to-point, not ``all_to_all_single``: it needs no
process group per shard group (FSDP x TP's groups span two mesh dims,
pipeline stages' ranks are disjoint), and a rank posts only to the peers it
has matrices with. The bytes moved are the same either way.

Matching: NCCL pairs a pair's messages by the order they are posted, gloo
by their tag and then that order, so every rank must post its exchanges in
the same global order (``step``'s phases: inputs of bucket 0, inputs of
bucket b+1, returns of bucket b, ...). Within one exchange each pair has at
most one message per direction, so the order inside it does not matter.

Pieces are padded to ``_ALIGN`` bytes so each one views back as its dtype.
On CUDA the transfers run on the process group's own stream, so they
overlap the Newton-Schulz kernels on the compute stream; ``wait`` makes the
compute stream (not the host) wait for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Exchange", "Spec"]

_ALIGN = 16


@dataclass(frozen=True)
class Spec:
    """A tensor to receive: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class Exchange:
    """Tensors to send and to receive, per peer rank (in an order both sides agree on)."""

    device: torch.device
    sends: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    recvs: dict[int, list[Spec]] = field(default_factory=dict)
    nbytes_sent: int = 0
    nbytes_received: int = 0
    _works: list = field(default_factory=list)
    _in: dict[int, torch.Tensor] = field(default_factory=dict)
    _out: dict[int, torch.Tensor] = field(default_factory=dict)

    def send(self, peer: int, t: torch.Tensor) -> None:
        if t.numel():
            self.sends.setdefault(peer, []).append(t)

    def recv(self, peer: int, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Ask for a tensor from ``peer``; returns its index among that peer's (``wait()[peer][i]``),
        -1 for an empty one (nothing travels)."""
        spec = Spec(tuple(shape), dtype)
        if spec.nbytes == 0:
            return -1
        self.recvs.setdefault(peer, []).append(spec)
        return len(self.recvs[peer]) - 1

    def start(self) -> Exchange:
        """Pack and post every message (nothing is posted when there is nothing to move)."""
        ops = []
        for peer in sorted(self.sends):
            ts = self.sends[peer]
            buf = torch.empty(sum(_padded(t.nbytes) for t in ts), dtype=torch.uint8, device=self.device)
            at = 0
            for t in ts:
                buf[at:at + t.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
                at += _padded(t.nbytes)
            self._out[peer] = buf
            ops.append(dist.P2POp(dist.isend, buf, peer))
        self.sends = {}  # the packed copies are what travel; the caller's tensors may go
        for peer in sorted(self.recvs):
            buf = torch.empty(sum(_padded(s.nbytes) for s in self.recvs[peer]), dtype=torch.uint8,
                              device=self.device)
            self._in[peer] = buf
            ops.append(dist.P2POp(dist.irecv, buf, peer))
        self.nbytes_sent = sum(b.numel() for b in self._out.values())
        self.nbytes_received = sum(b.numel() for b in self._in.values())
        if ops:
            self._works = dist.batch_isend_irecv(ops)
        return self

    def wait(self) -> dict[int, list[torch.Tensor]]:
        """Wait for every message; the received tensors per peer (views into the received buffers)."""
        for work in self._works:
            work.wait()
        self._works = []
        self._out = {}
        out = {}
        for peer, specs in self.recvs.items():
            buf, at, views = self._in[peer], 0, []
            for s in specs:
                views.append(buf[at:at + s.nbytes].view(s.dtype).view(s.shape))
                at += _padded(s.nbytes)
            out[peer] = views
        return out
