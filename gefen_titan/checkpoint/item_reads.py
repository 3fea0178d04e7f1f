"""How a checked reader (``checkpoint.reading``) reads an item's bytes: each piece hashed while it is
still in cache (one pass over memory, not two), raw items into uninitialized buffers (no zero fill) or
straight into their target, torch.saved items as ``bytes`` that ``io.BytesIO`` reads in place.

Every function returns fewer bytes than asked at the end of the file; the caller compares. The caller
also bounds ``length`` by the file's size before calling (``load_checks``: items inside files), since
each allocates what it is asked for.
"""

from __future__ import annotations

from typing import Any

import torch

from gefen_titan.checkpoint import digests as dg

__all__ = ["read_into", "read_raw", "read_framed"]


def _fill(f: Any, view: memoryview, hasher: Any) -> int:
    """Read into ``view`` piece by piece, each piece hashed while it is still
    in cache (one pass over memory, not two); the bytes read."""
    n = 0
    while n < len(view):
        got = f.readinto(view[n:n + dg.PIECE])
        if not got:
            break
        if hasher is not None:
            hasher.update(view[n:n + got])
        n += got
    return n


def read_into(f: Any, target: torch.Tensor, hasher: Any) -> memoryview:
    """Fill a contiguous CPU tensor's bytes from ``f``; the bytes read (fewer at the end of the file)."""
    if not target.nbytes:
        return memoryview(b"")
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    return view[:_fill(f, view, hasher)]


def read_raw(f: Any, length: int, hasher: Any) -> memoryview:
    """A raw item's bytes (fewer at the end of the file) in an uninitialized
    buffer (no zero fill), which the item is then viewed in without a copy."""
    view = memoryview(torch.empty(length, dtype=torch.uint8).numpy())
    return view[:_fill(f, view, hasher)]


def read_framed(f: Any, length: int, hasher: Any) -> bytes:
    """A torch.saved item's bytes (fewer at the end of the file), as ``bytes``:
    ``io.BytesIO`` then reads them in place, without a copy."""
    parts, n = [], 0
    while n < length:
        part = f.read(length - n)
        if not part:
            break
        if hasher is not None:
            hasher.update(part)
        parts.append(part)
        n += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)
