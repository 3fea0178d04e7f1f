"""Triton kernels for the contract of ``quant.py``, bit-identical to its reference.

A reshard of a large model dequantizes and requantizes every byte of momentum
a rank holds; in torch that is a dozen passes over fp32/int64 temporaries
(``repeat_interleave``, ``index_select``, ``searchsorted``, ``where``), here one
pass per operation. Call these through ``quant`` (which dispatches), not
directly.

Why each kernel gives exactly the reference's bits:

* every float operation is a single IEEE fp32 operation done in the same
  order as in ``quant`` (``div_rn``, not Triton's default ``/``, which may be
  approximate on GPUs; there are no ``a*b+c`` patterns to contract);
* the nearest-codeword search is the same ``searchsorted`` (a branch-free
  binary search over the 256 codewords gives the same index, duplicates
  included), with the same tie rule and clamping;
* max-abs is order-independent; the block mean follows ``quant.block_mean``'s
  fixed order (pairwise trees over ``MEAN_CHUNK``-wide chunks, added left to
  right).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same
kernels run on CPU tensors through Triton's interpreter: that is how they are
tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from gefen_titan.optim.quant.segments import MEAN_CHUNK, Segment

__all__ = ["INTERPRETED", "dequantize_segments", "requantize", "block_mean_segments"]

_K, _LOG2K = 256, 8
_TILE = 2048  # elements a program handles at once
_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # finite <=> |x| <= FLT_MAX (NaN compares false)


@triton.jit
def _count_below(table_ptr, x, LOG2N: tl.constexpr, INCLUSIVE: tl.constexpr):
    """Entries of the sorted ``table[0 : 2**LOG2N]`` that are < x (<= x if INCLUSIVE).

    Branch-free binary search: ``torch.searchsorted`` with side left (right),
    duplicates included.
    """
    pos = tl.zeros(x.shape, tl.int32)
    for k in tl.static_range(LOG2N):
        step = 1 << (LOG2N - 1 - k)
        probe = tl.load(table_ptr + (pos + (step - 1)))
        hit = (probe <= x) if INCLUSIVE else (probe < x)
        pos = tl.where(hit, pos + step, pos)
    probe = tl.load(table_ptr + pos)
    hit = (probe <= x) if INCLUSIVE else (probe < x)
    return tl.where(hit, pos + 1, pos)


@triton.jit
def _locate(e, table_ptr, NP: tl.constexpr, LOG2NP: tl.constexpr):
    """(segment, index into the packed per-block values) of output element ``e``.

    ``table`` rows: output start, period, phase, values offset of each
    segment, padded to NP = 2**LOG2NP with starts past every element.
    """
    seg = _count_below(table_ptr, e, LOG2NP, True) - 1
    start = tl.load(table_ptr + seg)
    period = tl.load(table_ptr + NP + seg)
    phase = tl.load(table_ptr + 2 * NP + seg)
    offset = tl.load(table_ptr + 3 * NP + seg)
    return seg, offset + (e - start + phase) // period


@triton.jit
def _dequantize_kernel(codes_ptr, table_ptr, codebooks_ptr, values_ptr, out_ptr, n,
                       NP: tl.constexpr, LOG2NP: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr,
                       BF16: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    e = pid * BLOCK + tl.arange(0, BLOCK)
    mask = e < n
    seg, vi = _locate(e, table_ptr, NP, LOG2NP)
    code = tl.load(codes_ptr + e, mask=mask, other=0).to(tl.int32)
    word = tl.load(codebooks_ptr + seg * 256 + code, mask=mask, other=0.0)
    mag = tl.load(values_ptr + vi, mask=mask, other=0.0)
    dense = word * mag
    if BF16:  # out is int16 bits: see _bf16_bits
        tl.store(out_ptr + e, _bf16_bits(dense), mask=mask)
    else:
        tl.store(out_ptr + e, dense, mask=mask)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits, round to nearest even (torch's rule, NaN -> 0x7FC0).

    Spelled out in integers because Triton's interpreter truncates in
    ``.to(tl.bfloat16)`` while GPUs round: this way both give torch's bits.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return tl.where(x != x, 0x7FC0, bits).to(tl.int16)


@triton.jit
def _quantize_chunk(m, mag, mask, offs, codebook_ptr, codes_ptr):
    """Codes of the fp32 chunk ``m`` [ROWS, C] against its rows' ``mag``."""
    safe = tl.where(mag > 0, mag, 1.0)
    x = tl.where(mag[:, None] > 0, tl.math.div_rn(m, safe[:, None]), 0.0)
    pos = _count_below(codebook_ptr, x, 8, False)
    left = tl.maximum(pos - 1, 0)
    right = tl.minimum(pos, 255)
    near_left = tl.abs(x - tl.load(codebook_ptr + left)) <= tl.abs(x - tl.load(codebook_ptr + right))
    tl.store(codes_ptr + offs, tl.where(near_left, left, right).to(tl.uint8), mask=mask)


@triton.jit
def _requantize_kernel(dense_ptr, codebook_ptr, codes_ptr, mag_ptr, flag_ptr, nblocks, period,
                       ROWS: tl.constexpr, C: tl.constexpr, ONE_CHUNK: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < nblocks
    base = rows * period
    cols = tl.arange(0, C)
    if ONE_CHUNK:  # the whole block is in registers: read once
        mask = rmask[:, None] & (cols < period)[None, :]
        offs = base[:, None] + cols[None, :]
        m = tl.load(dense_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bad = tl.max(tl.where(mask & ~(tl.abs(m) <= _FLT_MAX), 1, 0), axis=1)
        mag = tl.max(tl.abs(m), axis=1)
        _quantize_chunk(m, mag, mask, offs, codebook_ptr, codes_ptr)
    else:  # long blocks: a pass for the max, a pass for the codes
        mag = tl.zeros([ROWS], tl.float32)
        bad = tl.zeros([ROWS], tl.int32)
        for c0 in range(0, period, C):
            mask = rmask[:, None] & (c0 + cols < period)[None, :]
            m = tl.load(dense_ptr + base[:, None] + (c0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            bad = tl.maximum(bad, tl.max(tl.where(mask & ~(tl.abs(m) <= _FLT_MAX), 1, 0), axis=1))
            mag = tl.maximum(mag, tl.max(tl.abs(m), axis=1))
        for c0 in range(0, period, C):
            mask = rmask[:, None] & (c0 + cols < period)[None, :]
            offs = base[:, None] + (c0 + cols)[None, :]
            m = tl.load(dense_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            _quantize_chunk(m, mag, mask, offs, codebook_ptr, codes_ptr)
    tl.store(mag_ptr + rows, mag, mask=rmask)
    nonfinite = tl.max(bad, axis=0)  # non-finite input: raised by the launcher
    tl.store(flag_ptr, nonfinite, mask=nonfinite > 0)


@triton.jit
def _block_mean_kernel(table_ptr, values_ptr, out_ptr, nblocks, period,
                       NP: tl.constexpr, LOG2NP: tl.constexpr, ROWS: tl.constexpr, C: tl.constexpr,
                       LOG2C: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < nblocks
    cols = tl.arange(0, C)
    acc = tl.zeros([ROWS], tl.float32)
    lo = tl.full([ROWS], _FLT_MAX, tl.float32)
    hi = tl.full([ROWS], -_FLT_MAX, tl.float32)
    for c0 in range(0, period, C):
        mask = rmask[:, None] & (c0 + cols < period)[None, :]
        e = rows[:, None] * period + (c0 + cols)[None, :]
        _, vi = _locate(e, table_ptr, NP, LOG2NP)
        v = tl.load(values_ptr + vi, mask=mask, other=0.0)
        lo = tl.minimum(lo, tl.min(tl.where(mask, v, _FLT_MAX), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(mask, v, -_FLT_MAX), axis=1))
        for k in tl.static_range(LOG2C):  # adjacent pairs, level by level
            a, b = tl.split(tl.reshape(v, [ROWS, C >> (k + 1), 2]))
            v = a + b
        acc = acc + tl.reshape(v, [ROWS])
    mean = tl.math.div_rn(acc, tl.zeros([ROWS], tl.float32) + period)
    tl.store(out_ptr + rows, tl.where(lo == hi, hi, mean), mask=rmask)


INTERPRETED = not isinstance(_requantize_kernel, triton.runtime.JITFunction)


# ------------------------------------------------------------------ launchers
def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _table(segments: Sequence[Segment], values: str, device: torch.device, extra: int):
    """(int table [4, NP], packed fp32 per-block values, NP, wide) for ``_locate``."""
    packed, starts, periods, phases, offsets = [], [], [], [], []
    pos = off = 0
    for s in segments:
        first, last = s.blocks
        packed.append(getattr(s, values).reshape(-1)[first:last].to(device=device, dtype=torch.float32))
        starts.append(pos)
        periods.append(s.period)
        phases.append(s.phase)
        offsets.append(off)
        pos += s.length
        off += last - first
    wide = pos + max(periods) + extra >= 2**31 - 1 or off >= 2**31 - 1
    np_ = _pow2(len(segments))
    pad = np_ - len(segments)
    far = 2**62 if wide else 2**31 - 1
    rows = [starts + [far] * pad, periods + [1] * pad, phases + [0] * pad, offsets + [0] * pad]
    table = torch.tensor(rows, dtype=torch.int64 if wide else torch.int32).to(device)
    return table, torch.cat(packed), np_, wide


def dequantize_segments(codes: torch.Tensor, segments: Sequence[Segment], out_dtype: torch.dtype) -> torch.Tensor:
    device = codes.device
    for s in segments:
        if s.codebook.numel() != _K:
            raise ValueError(f"dequantize kernel: codebooks must have {_K} codewords, got {s.codebook.numel()}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize kernel writes float32 or bfloat16, not {out_dtype}")
    n = codes.numel()
    block = _TILE
    table, mags, np_, wide = _table(segments, "magnitude", device, block)
    codebooks = torch.stack([s.codebook.reshape(-1).to(device=device, dtype=torch.float32) for s in segments])
    out = torch.empty(n, dtype=out_dtype, device=device)
    _dequantize_kernel[(triton.cdiv(n, block),)](
        codes.contiguous(), table, codebooks, mags, out.view(torch.int16) if out_dtype == torch.bfloat16 else out, n,
        NP=np_, LOG2NP=np_.bit_length() - 1, BLOCK=block, WIDE=wide, BF16=out_dtype == torch.bfloat16, num_warps=4,
    )
    return out


def requantize(dense: torch.Tensor, codebook: torch.Tensor, period: int) -> tuple[torch.Tensor, torch.Tensor]:
    if codebook.numel() != _K:
        raise ValueError(f"requantize kernel: codebook must have {_K} codewords, got {codebook.numel()}")
    dense = dense.reshape(-1).contiguous()
    device, n = dense.device, dense.numel()
    nblocks = n // period
    codes = torch.empty(n, dtype=torch.uint8, device=device)
    magnitude = torch.empty(nblocks, dtype=torch.float32, device=device)
    if n:
        width = min(_pow2(period), _TILE)
        rows = max(1, _TILE // width)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        _requantize_kernel[(triton.cdiv(nblocks, rows),)](
            dense, codebook.reshape(-1).to(device=device, dtype=torch.float32).contiguous(), codes, magnitude, flag,
            nblocks, period, ROWS=rows, C=width, ONE_CHUNK=period <= width,
            WIDE=n + rows * period + width >= 2**31 - 1, num_warps=4,
        )
        if flag.item():
            raise ValueError("requantize: momentum has non-finite values")
    return codes.view(nblocks, period), magnitude.view(nblocks, 1)


def block_mean_segments(segments: Sequence[Segment], period: int) -> torch.Tensor:
    device = segments[0].vmean.device
    n = sum(s.length for s in segments)
    nblocks = n // period
    width = min(_pow2(period), MEAN_CHUNK)
    rows = max(1, _TILE // width)
    table, vmean, np_, wide = _table(segments, "vmean", device, rows * period + width)
    out = torch.empty(nblocks, dtype=torch.float32, device=device)
    _block_mean_kernel[(triton.cdiv(nblocks, rows),)](
        table, vmean, out, nblocks, period,
        NP=np_, LOG2NP=np_.bit_length() - 1, ROWS=rows, C=width, LOG2C=width.bit_length() - 1, WIDE=wide, num_warps=4,
    )
    return out.view(nblocks, 1)
