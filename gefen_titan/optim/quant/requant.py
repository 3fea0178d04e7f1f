"""Dequantize and requantize Gefen momentum: the contract and its reference.

These are the two hot operations of a reshard. They follow Gefen's own
arithmetic exactly (``gefen.gefen``: ``gefen_dequantize_unpacked_indices`` and
``_automatic_momentum_update``), so a state requantized here is the state
Gefen itself would have written:

* dequantize: ``m[i] = codebook[code[i]] * magnitude[block(i)]`` (fp32
  product, then cast to the output dtype);
* requantize: per block ``magnitude = max |m|``; ``x = m / magnitude`` (0 where
  the magnitude is 0); ``code = nearest codeword`` by ``searchsorted`` into the
  sorted codebook, ties to the lower index, out-of-range values clamped.
  Non-finite input raises ``ValueError``: a NaN would otherwise become a
  silent code.

A resharded shard is a concatenation of *segments*: runs of elements that
come from one source shard, so share one codebook and one block period, and
start ``start`` elements into that source shard (not necessarily on a block
boundary). ``dequantize_segments`` and ``block_mean_segments`` take the whole
list at once, so the GPU path is one kernel launch per shard, not one per
source rank.

Each public entry point has two implementations with bit-identical results:
the pure-torch reference in this module, and the Triton kernels of
``kernels.py``. ``GEFEN_TITAN_KERNELS`` (or ``use_backend``) picks one:

* ``auto`` (default): kernels for CUDA tensors, the reference otherwise;
* ``triton``: always the kernels. On CPU tensors that needs Triton's
  interpreter (``TRITON_INTERPRET=1`` set before ``kernels`` is imported), which
  is how the kernel code is tested without a GPU;
* ``reference``: always the reference.

The block mean (``vmean`` of a target block that spans several source blocks)
is a sum, whose rounding depends on the order of the additions; the order is
fixed here (``block_mean``) and the kernel follows it, so both are bit-exact.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch

from gefen_titan.optim.quant.segments import MEAN_CHUNK, Segment

__all__ = [
    "Segment",
    "dequantize",
    "dequantize_segments",
    "requantize",
    "nearest_codes",
    "block_mean",
    "block_mean_segments",
    "expand_blocks",
    "backend_for",
    "set_backend",
    "use_backend",
]

# Bound the int64/fp32 temporaries of the codeword search (as gefen-x does).
_CHUNK = 1 << 22

ENV = "GEFEN_TITAN_KERNELS"
_MODES = ("auto", "triton", "reference")
_forced: str | None = None


# ------------------------------------------------------------------ dispatch
def _mode() -> str:
    mode = _forced or os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def set_backend(mode: str | None) -> None:
    """Force ``auto``/``triton``/``reference`` for this process (``None``: back to ``$GEFEN_TITAN_KERNELS``)."""
    global _forced
    if mode is not None and mode not in _MODES:
        raise ValueError(f"backend {mode!r}: expected one of {', '.join(_MODES)}")
    _forced = mode


@contextlib.contextmanager
def use_backend(mode: str) -> Iterator[None]:
    """``set_backend`` for the duration of a ``with`` block."""
    global _forced
    before = _forced
    set_backend(mode)
    try:
        yield
    finally:
        _forced = before


def backend_for(t: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"``: what the entry points run for tensors like ``t``."""
    mode = _mode()
    if mode == "reference":
        return "reference"
    if t.is_cuda:
        if mode == "triton":
            return "triton"
        try:
            import triton  # noqa: F401, PLC0415 (only asks whether Triton is installed)
        except ImportError:
            return "reference"
        return "triton"
    if mode == "auto":
        return "reference"
    kernels = _kernels()
    if not kernels.INTERPRETED:
        raise RuntimeError(
            f"{ENV}=triton on {t.device} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before gefen_titan.optim.quant.kernels is first imported (or use CUDA tensors)"
        )
    return "triton"


def _kernels():
    # Imported on first use: it imports Triton, and on CPU tensors Triton's
    # interpreter must be chosen (TRITON_INTERPRET=1) before that import.
    from gefen_titan.optim.quant import kernels  # noqa: PLC0415

    return kernels


def _check_segments(segments: Sequence[Segment], n: int | None, what: str) -> None:
    total = 0
    for s in segments:
        if s.length < 0 or s.period <= 0 or s.start < 0:
            raise ValueError(f"{what}: bad segment (length {s.length}, period {s.period}, start {s.start})")
        values = s.vmean if what == "block_mean_segments" else s.magnitude
        if values is None or (what != "block_mean_segments" and s.codebook is None):
            lacks = "vmean" if what == "block_mean_segments" else "codebook/magnitude"
            raise ValueError(f"{what}: segment lacks {lacks}")
        if s.length and values.numel() < s.blocks[1]:
            raise ValueError(f"{what}: segment needs blocks up to {s.blocks[1]}, has {values.numel()}")
        total += s.length
    if n is not None and total != n:
        raise ValueError(f"{what}: segments cover {total} elements, codes have {n}")


# ------------------------------------------------------------------ reference
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
    """Dense momentum of one segment (reference; see ``dequantize_segments``).

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


def _requantize_reference(dense: torch.Tensor, codebook: torch.Tensor,
                          period: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not torch.isfinite(dense).all():
        raise ValueError("requantize: momentum has non-finite values")
    m = dense.float().reshape(-1, period)
    magnitude = m.abs().amax(dim=1, keepdim=True)
    # Tensor / tensor: a Python-scalar divisor may become a multiply by its reciprocal.
    x = torch.where(magnitude > 0, m / magnitude, torch.zeros_like(m))
    return nearest_codes(codebook.float(), x), magnitude


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by adding adjacent pairs, level by level."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def block_mean(values: torch.Tensor, period: int) -> torch.Tensor:
    """Per-block mean, fp32 [n/period, 1] (the block second moment ``vmean``).

    The order of the additions is part of the contract, so that the kernel
    gives the same bits: a block whose values are all equal has exactly that
    value as its mean; otherwise the block is cut into chunks of
    ``C = min(next_pow2(period), MEAN_CHUNK)`` elements (the last one padded
    with zeros), each chunk is summed as a pairwise tree of adjacent elements,
    the chunk sums are added left to right onto 0, and the total is divided by
    ``period`` (IEEE fp32 division).
    """
    v = values.float().reshape(-1, period)
    rows = v.shape[0]
    width = min(1 << max(period - 1, 0).bit_length(), MEAN_CHUNK)
    nchunks = -(-period // width)
    padded = torch.nn.functional.pad(v, (0, nchunks * width - period)).reshape(rows, nchunks, width)
    sums = _tree_sum(padded)
    acc = torch.zeros(rows, dtype=torch.float32, device=v.device)
    for k in range(nchunks):
        acc = acc + sums[:, k]
    mean = acc / torch.full_like(acc, float(period))
    if rows:
        lo, hi = v.amin(dim=1), v.amax(dim=1)
        mean = torch.where(lo == hi, hi, mean)
    return mean.reshape(rows, 1)


def _dequantize_segments_reference(codes, segments, out_dtype):
    out = torch.empty(codes.numel(), dtype=out_dtype, device=codes.device)
    pos = 0
    for s in segments:
        seg = codes[pos : pos + s.length]
        out[pos : pos + s.length] = dequantize(seg, s.codebook.float(), s.magnitude.float(), s.period, s.start,
                                               out_dtype)
        pos += s.length
    return out


def _block_mean_segments_reference(segments, period):
    per_element = torch.cat([expand_blocks(s.vmean.float(), s.period, s.start, s.start + s.length) for s in segments])
    return block_mean(per_element, period)


# ------------------------------------------------------------------ entry points
def dequantize_segments(
    codes: torch.Tensor, segments: Sequence[Segment], out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dense momentum [n] of a shard whose flat ``codes`` are ``segments`` end to end.

    Element ``i`` of segment ``s`` is ``s.codebook[codes[i]] * s.magnitude[block]``
    with ``block = (s.start + i - offset_of_s) // s.period``.
    """
    codes = codes.reshape(-1)
    segments = [s for s in segments if s.length]
    _check_segments(segments, codes.numel(), "dequantize_segments")
    if not segments:
        return torch.empty(0, dtype=out_dtype, device=codes.device)
    # The kernel writes fp32 or bf16; other dtypes take the reference unless kernels are forced.
    if backend_for(codes) == "triton" and (out_dtype in (torch.float32, torch.bfloat16) or _mode() == "triton"):
        return _kernels().dequantize_segments(codes, segments, out_dtype)
    return _dequantize_segments_reference(codes, segments, out_dtype)


def requantize(dense: torch.Tensor, codebook: torch.Tensor, period: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n/period, period], magnitude fp32 [n/period, 1]).

    Raises ``ValueError`` on non-finite input: a NaN would otherwise become a
    silent code.
    """
    n = dense.numel()
    if period <= 0 or n % period:
        raise ValueError(f"requantize: {n} elements are not whole blocks of {period}")
    if backend_for(dense) == "triton":
        return _kernels().requantize(dense, codebook, period)
    return _requantize_reference(dense, codebook, period)


def block_mean_segments(segments: Sequence[Segment], period: int) -> torch.Tensor:
    """``block_mean`` of the segments' per-element ``vmean``, fp32 [n/period, 1].

    A target block inside one source block gets that block's ``vmean``
    exactly; one spanning several gets their element-weighted mean.
    """
    segments = [s for s in segments if s.length]
    _check_segments(segments, None, "block_mean_segments")
    n = sum(s.length for s in segments)
    if period <= 0 or n % period:
        raise ValueError(f"block_mean_segments: {n} elements are not whole blocks of {period}")
    if not segments:
        return torch.empty(0, 1, dtype=torch.float32)
    if backend_for(segments[0].vmean) == "triton":
        return _kernels().block_mean_segments(segments, period)
    return _block_mean_segments_reference(segments, period)
