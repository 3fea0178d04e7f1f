"""The digests' hashers and keys: xxh3-64, or keyed BLAKE2b-64 (a MAC) with the key a job names.

Part of ``checkpoint.format.digests`` (which re-exports every name here): how one
digest is computed, the key from ``checkpoint.digest_key_env``, and the
scope (``keyed``) within which the readers made on a thread check digests
with it. The key is never written or logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import xxhash

from gefen_titan.checkpoint.errors import GefenCheckpointError

__all__ = ["ALGORITHM", "KEYED_ALGORITHM", "new_hasher", "hexdigest", "algorithm", "key_from_env", "keyed",
           "current_key"]

ALGORITHM = "xxh3_64"
KEYED_ALGORITHM = "blake2b64_keyed"  # BLAKE2b with the key, 8-byte digests (16 hex digits, as xxh3-64's)
_scope = threading.local()  # keyed's: .key, while a keyed scope runs on this thread


def new_hasher(key: bytes | None = None) -> Any:
    """A streaming hasher (``update(bytes-like)``, ``hexdigest()``): xxh3-64, or keyed BLAKE2b-64 with ``key``."""
    return xxhash.xxh3_64() if key is None else hashlib.blake2b(key=key, digest_size=8)


def hexdigest(data: Any, key: bytes | None = None) -> str:
    """The digest of one bytes-like object, as the file stores it (16 lower-case hex digits)."""
    if key is None:
        return xxhash.xxh3_64_hexdigest(data)
    return hashlib.blake2b(data, key=key, digest_size=8).hexdigest()


def algorithm(key: bytes | None) -> str:
    return ALGORITHM if key is None else KEYED_ALGORITHM


def key_from_env(name: str) -> bytes | None:
    """The key held by environment variable ``name`` (``checkpoint.digest_key_env``); None when ``name`` is empty.

    A named variable that is unset or empty is an error, not "no key": a
    job meant to sign and check its checkpoints must not silently stop.
    """
    if not name:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise GefenCheckpointError(
            f"checkpoint.digest_key_env names {name}, which is not set in this process's environment: set it "
            "(the same key the checkpoints were saved with) or clear checkpoint.digest_key_env")
    key = value.encode()
    if len(key) > 64:  # BLAKE2b's key limit: longer keys are hashed down first, as HMAC does
        key = hashlib.blake2b(key).digest()
    return key


@contextlib.contextmanager
def keyed(key: bytes | None) -> Iterator[None]:
    """Within it, the readers made on this thread check digests with ``key`` (None: unkeyed)."""
    outer = getattr(_scope, "key", None)
    _scope.key = key
    try:
        yield
    finally:
        _scope.key = outer


def current_key() -> bytes | None:
    """The key of the innermost ``keyed`` scope on this thread (None outside one)."""
    return getattr(_scope, "key", None)
