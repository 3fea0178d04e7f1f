"""Dequantize and requantize Gefen momentum: the reference (pure torch) pair.

These are the two hot operations of a reshard. They follow Gefen's own
arithmetic exactly (``gefen.gefen``: ``gefen_dequantize_unpacked_indices`` and
``_automatic_momentum_update``), so a state requantized here is the state
Gefen itself would have written:

* dequantize: ``m[i] = codebook[code[i]] * magnitude[block(i)]``;
* requantize: per block ``magnitude = max |m|``; ``x = m / magnitude`` (0 where
  the magnitude is 0); ``code = nearest codeword`` by ``searchsorted`` into the
  sorted codebook, ties to the lower index, out-of-range values clamped.

Everything here is flat (1-D) and per *segment*: a run of elements that share
one codebook and one period, starting ``phase`` elements into its first
block. A resharded shard is a concatenation of such segments.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize", "expand_blocks", "requantize", "nearest_codes", "block_mean"]

# Bound the int64/fp32 temporaries of the codeword search (as gefen-x does).
_CHUNK = 1 << 22


def expand_blocks(values: torch.Tensor, period: int, start: int, stop: int) -> torch.Tensor:
    """Per-element view of per-block ``values`` for elements [start, stop).

    ``values`` holds one value per block of ``period`` elements, element 0
    being the first of block 0.
    """
    if stop <= start:
        return values.new_empty(0)
    first, last = start // period, (stop - 1) // period
    expanded = values.reshape(-1)[first : last + 1].repeat_interleave(period)
    offset = first * period
    return expanded[start - offset : stop - offset]


def dequantize(
    codes: torch.Tensor,
    codebook: torch.Tensor,
    magnitude: torch.Tensor,
    period: int,
    start: int = 0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense momentum of one segment.

    ``codes`` are the uint8 codes of elements [start, start + len(codes)) of
    a source shard whose blocks are ``period`` long and whose per-block
    magnitudes are ``magnitude``.
    """
    codes = codes.reshape(-1)
    mag = expand_blocks(magnitude, period, start, start + codes.numel())
    dense = codebook.index_select(0, codes.long()) * mag
    return dense.to(out_dtype)


def nearest_codes(codebook: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codeword of a sorted codebook; ties go low."""
    k = codebook.numel()
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=flat.device)
    for lo in range(0, flat.numel(), _CHUNK):
        seg = flat[lo : lo + _CHUNK].float()
        idx = torch.searchsorted(codebook, seg)
        left = (idx - 1).clamp_(0, k - 1)
        right = idx.clamp_(0, k - 1)
        pick = torch.where((seg - codebook[left]).abs() <= (seg - codebook[right]).abs(), left, right)
        out[lo : lo + _CHUNK] = pick.to(torch.uint8)
    return out.view(x.shape)


def requantize(dense: torch.Tensor, codebook: torch.Tensor, period: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n/period, period], magnitude fp32 [n/period, 1]).

    Raises on non-finite input: a NaN would otherwise become a silent code.
    """
    if not torch.isfinite(dense).all():
        raise ValueError("requantize: momentum has non-finite values")
    m = dense.float().reshape(-1, period)
    magnitude = m.abs().amax(dim=1, keepdim=True)
    x = torch.where(magnitude > 0, m / magnitude, torch.zeros_like(m))
    return nearest_codes(codebook, x), magnitude


def block_mean(values: torch.Tensor, period: int) -> torch.Tensor:
    """Per-block mean, fp32 [n/period, 1] (the block second moment ``vmean``)."""
    return values.float().reshape(-1, period).mean(dim=1, keepdim=True)
