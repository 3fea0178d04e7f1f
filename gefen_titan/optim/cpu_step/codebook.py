"""A codebook's nearest-codeword rule as thresholds and a lookup table, for the kernel.

gefen-x 0.5.0 assigns a value x its nearest codeword by ``searchsorted`` into
the sorted codebook, then ``|x - c[left]| <= |x - c[right]|`` (ties to the
lower index), in fp32 (``quant.requant.nearest_codes`` is the same rule,
pinned against gefen-x by ``tests/unit/test_contract_gefen.py``). Both
roundings are monotone in x, so the code never decreases as x grows: the code
of x is the number of thresholds ``T_j`` (the least x whose code is >= j) at
or below x. Each threshold is found here by bisection over the floats, in
their order-preserving uint32 keys, asking the rule (``codes_of_keys``), so the kernel
reproduces it exactly, duplicate codewords included (two equal thresholds: a
code that is never chosen). NaN is not ordered: its code is asked separately.

The kernel looks a key up in a 65536-entry table indexed by its top 16 bits:
the code at the bucket's first key, the code above the bucket's one
threshold, and that threshold's low 16 bits. A bucket that holds two or
more distinct thresholds (codewords closer than about 1/128 of their value,
common near 0) is flagged and points to a row of 256 finer entries indexed by
the key's next 8 bits; a flagged fine entry (codewords within 256 ulps) is
counted by binary search over the thresholds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from gefen_titan.optim.quant.requant import nearest_codes

__all__ = ["CodebookTable", "KEY_MAX", "KEY_MIN", "codes_of_keys", "floats_of_keys", "keys_of", "table_for"]

KEY_MIN = 0x007FFFFF  # key(-inf)
KEY_MAX = 0xFF800000  # key(+inf)
_FLAGGED = 0xFF  # lo = 255, hi = 0: "count by binary search"


@dataclass(frozen=True)
class CodebookTable:
    """What the kernel needs of one codebook for tensors of one dtype (all CPU, contiguous)."""

    values: torch.Tensor  # fp32 [k]: each codeword rounded to the dtype (as gefen-x's dequantize), as float
    table: torch.Tensor  # int32 [65536]
    fine: torch.Tensor  # int32 [256 * flagged buckets]
    thresholds: torch.Tensor  # int32 [k - 1] (uint32 keys), non-decreasing
    nan_code: int


def keys_of(x: np.ndarray) -> np.ndarray:
    """Order-preserving uint32 keys (as int64) of float32 values (NaN excluded)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)
    return np.where(u >= 0x80000000, 0xFFFFFFFF - u, u | 0x80000000)


def floats_of_keys(keys: np.ndarray) -> np.ndarray:
    """The float32 values of order-preserving keys (inverse of ``keys_of``)."""
    k = np.asarray(keys, dtype=np.int64)
    u = np.where(k >= 0x80000000, k ^ 0x80000000, 0xFFFFFFFF - k)
    return u.astype(np.uint32).view(np.float32)


def codes_of_keys(codebook: torch.Tensor, keys: np.ndarray) -> np.ndarray:
    """gefen-x's code of each key's float (int64), by the rule in numpy's float32 arithmetic.

    The same comparisons and float32 subtractions as ``nearest_codes`` (torch),
    so the same codes (``tests/unit/test_cpu_step.py`` checks the kernel's
    codes against ``nearest_codes`` on both sides of every threshold), but
    without torch's fixed cost per call (its CPU ``searchsorted`` takes ~20 ms
    even for 255 values), which the bisection pays 33 times per codebook.
    """
    cb = codebook.detach().cpu().numpy().astype(np.float32)
    k = len(cb)
    if k <= 1:
        return np.zeros(len(keys), dtype=np.int64)
    x = floats_of_keys(keys)
    idx = np.searchsorted(cb, x, side="left")
    left, right = np.clip(idx - 1, 0, k - 1), np.clip(idx, 0, k - 1)
    return np.where(np.abs(x - cb[left]) <= np.abs(x - cb[right]), left, right).astype(np.int64)


def _thresholds(codebook: torch.Tensor) -> np.ndarray:
    """T_j for j = 1..k-1: the least key whose code is >= j (KEY_MAX + 1 if none)."""
    k = codebook.numel()
    j = np.arange(1, k, dtype=np.int64)
    lo = np.full(k - 1, KEY_MIN, dtype=np.int64)  # invariant: code(lo) < j, or lo is KEY_MIN
    hi = np.full(k - 1, KEY_MAX + 1, dtype=np.int64)  # invariant: code(hi) >= j (KEY_MAX + 1: "never")
    at_min = codes_of_keys(codebook, np.array([KEY_MIN]))[0]
    hi[j <= at_min] = KEY_MIN
    while True:
        open_ = hi - lo > 1
        if not open_.any():
            break
        mid = (lo + hi) // 2
        up = codes_of_keys(codebook, mid) >= j
        hi = np.where(open_ & up, mid, hi)
        lo = np.where(open_ & ~up, mid, lo)
    return hi


def _entries(thresholds: np.ndarray, starts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Table entries of the key ranges [start, start + width): lo | hi << 8 | (threshold % width) << 16,
    and which ranges hold two or more distinct thresholds (flagged)."""
    ends = starts + width - 1
    lo = np.searchsorted(thresholds, starts, side="right")
    hi = np.searchsorted(thresholds, ends, side="right")
    distinct = np.unique(thresholds)
    first = np.searchsorted(distinct, starts, side="right")  # the first distinct threshold past the start
    inside = np.searchsorted(distinct, ends, side="right") - first
    thr = (distinct[np.minimum(first, len(distinct) - 1)] % width) if len(distinct) else np.zeros_like(lo)
    return np.where(inside == 0, lo | (lo << 8), lo | (hi << 8) | (thr << 16)), inside >= 2


def _tables(thresholds: np.ndarray, nan_code: int) -> tuple[np.ndarray, np.ndarray]:
    """The table by a key's top 16 bits and the fine rows of its flagged buckets (by the next 8 bits).

    NaN's keys lie beyond -inf's and +inf's: the buckets of NaN alone hold its code; the two that
    hold an infinity and NaNs are flagged, and so are those two keys' fine rows (counted by the kernel's
    scalar rule, which asks NaN first).
    """
    nan = nan_code | (nan_code << 8)
    coarse, flagged = _entries(thresholds, np.arange(1 << 16, dtype=np.int64) << 16, 1 << 16)
    low_inf, high_inf = KEY_MIN >> 16, KEY_MAX >> 16
    coarse[:low_inf] = nan
    coarse[high_inf + 1:] = nan
    flagged[:low_inf] = flagged[high_inf + 1:] = False
    flagged[[low_inf, high_inf]] = True
    rows = np.flatnonzero(flagged)
    starts = (rows[:, None] << 16) + (np.arange(256, dtype=np.int64) << 8)
    fine, again = _entries(thresholds, starts.reshape(-1), 256)
    fine, again = fine.reshape(-1, 256), again.reshape(-1, 256)
    for r, bucket in enumerate(rows):
        if bucket == low_inf:  # NaN keys, then -inf at the last key
            fine[r, :255], again[r, :255], again[r, 255] = nan, False, True
        elif bucket == high_inf:  # +inf at the first key, then NaN keys
            fine[r, 1:], again[r, 1:], again[r, 0] = nan, False, True
    fine[again] = _FLAGGED
    coarse[flagged] = _FLAGGED | (np.arange(len(rows)) << 16)
    return (coarse.astype(np.uint32).view(np.int32), fine.reshape(-1).astype(np.uint32).view(np.int32))


def _build(codebook: torch.Tensor, dtype: torch.dtype) -> CodebookTable:
    cb = codebook.detach().to("cpu", torch.float32).contiguous()
    if cb.dim() != 1 or not 1 <= cb.numel() <= 256:
        raise ValueError(f"codebook: expected 1 to 256 codewords, got shape {tuple(cb.shape)}")
    if not torch.isfinite(cb).all() or (cb.numel() > 1 and not bool((cb[1:] >= cb[:-1]).all())):
        raise ValueError("codebook: gefen-x's rule needs finite, sorted codewords")
    thresholds = _thresholds(cb) if cb.numel() > 1 else np.zeros(0, dtype=np.int64)
    nan_code = 0 if cb.numel() <= 1 else int(nearest_codes(cb, torch.tensor([float("nan")])).item())
    coarse, fine = _tables(thresholds, nan_code)
    return CodebookTable(
        values=cb.to(dtype).to(torch.float32).contiguous(),
        table=torch.from_numpy(coarse),
        fine=torch.from_numpy(fine),
        thresholds=torch.from_numpy(thresholds.astype(np.uint32).view(np.int32)),
        nan_code=nan_code,
    )


_CACHE: OrderedDict[tuple[bytes, torch.dtype], CodebookTable] = OrderedDict()
_CACHE_SIZE = 8


def table_for(codebook: torch.Tensor, dtype: torch.dtype) -> CodebookTable:
    """The table of a codebook (by content) for tensors of ``dtype``; built once, then cached."""
    key = (codebook.detach().to("cpu", torch.float32).contiguous().numpy().tobytes(), dtype)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = _build(codebook, dtype)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    return hit
