"""What the reference (``quant``) and the Triton kernels (``kernels``) share.

A resharded shard is a concatenation of *segments*: runs of elements that
come from one source shard, so share one codebook and one block period. Both
implementations take the same ``Segment`` list and must give the same bits,
which for a block mean (a sum) also means the same order of additions:
``MEAN_CHUNK`` fixes it. Kept apart so that ``quant`` (which dispatches to the
kernels) and ``kernels`` (which implement its contract) do not import each
other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MEAN_CHUNK", "Segment"]

# Width of the pairwise-summed chunks of a block mean (``quant.block_mean``).
MEAN_CHUNK = 1024


@dataclass(frozen=True, eq=False)  # holds tensors: compare by identity
class Segment:
    """``length`` consecutive elements of one source shard.

    They start ``start`` elements into that shard, whose blocks are ``period``
    long; ``magnitude`` and ``vmean`` hold one value per source block (block 0
    starting at element 0), ``codebook`` the shard's 256 sorted codewords.
    """

    length: int
    period: int
    start: int
    codebook: torch.Tensor | None = None
    magnitude: torch.Tensor | None = None
    vmean: torch.Tensor | None = None

    @property
    def blocks(self) -> tuple[int, int]:
        """[first, last) source blocks the segment touches."""
        if self.length <= 0:
            return self.start // self.period, self.start // self.period
        return self.start // self.period, (self.start + self.length - 1) // self.period + 1

    @property
    def phase(self) -> int:
        """Offset of the segment's first element into its first block."""
        return self.start % self.period
