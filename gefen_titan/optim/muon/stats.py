"""What GefenMuon's sharded step measures on a rank, and the bound its buffers keep.

Benchmarks and tests read ``MuonStepStats`` (the container's ``step_stats``)
to check the step's claim about memory: per bucket a rank holds at most the
schedule's ``rank_bytes`` plus one copy of them (``COPIES``: a packed buffer,
or the received pieces of a matrix being assembled) and two buckets are live
(``SLOTS``), so the bytes in flight stay under ``SLOTS x COPIES x
schedule.limit_bytes``. ``InFlight`` is the counter the buckets keep it with.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COPIES", "SLOTS", "InFlight", "MuonStepStats"]

# Per bucket, a rank holds at most rank_bytes plus one copy of them; two buckets are live.
SLOTS, COPIES = 2, 2


@dataclass
class MuonStepStats:
    """What the steps since the last ``reset`` did on this rank (benchmarks read it)."""

    steps: int = 0
    seconds: float = 0.0
    ns_seconds: float = 0.0  # Newton-Schulz and NorMuon on the matrices this rank orthogonalizes
    ns_matrices: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_inflight_bytes: int = 0
    bound_bytes: int = 0  # SLOTS * COPIES * the schedule's limit
    buckets: int = 0
    sync_cuda: bool = False  # time the device work too (benchmarks; costs a sync per matrix)

    def reset(self) -> None:
        keep = (self.bound_bytes, self.buckets, self.sync_cuda)
        self.__init__()
        self.bound_bytes, self.buckets, self.sync_cuda = keep


class InFlight:
    """The bytes this rank's step holds now; its peak goes to ``stats.peak_inflight_bytes``."""

    def __init__(self, stats: MuonStepStats) -> None:
        self.live, self.stats = 0, stats

    def add(self, n: int) -> None:
        self.live += n
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self.live)

    def sub(self, n: int) -> None:
        self.live -= n
