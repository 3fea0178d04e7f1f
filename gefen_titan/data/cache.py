"""Where data built on first use is written, and the lock that makes the
ranks of one host build it once.

Two things are built from a corpus the first time a run reads it: a token
dataset (``gefen_titan.data.indexed_build.cached_dataset``) and the embedded
corpus cut into stream files (``gefen_titan.data.corpus.embedded_shards``).
Both go under one cache directory, keyed by content, and every rank of a
host starts them at the same moment: the first to take the lock builds, the
others wait and then find the result.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CACHE_ENV", "default_cache_dir", "locked"]

CACHE_ENV = "GEFEN_TITAN_CACHE"
"""Environment variable that moves the cache directory."""


def default_cache_dir() -> Path:
    """``$GEFEN_TITAN_CACHE``, else ``$XDG_CACHE_HOME/gefen_titan``, else ``~/.cache/gefen_titan``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gefen_titan"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (ranks on one host build once, the others wait)."""
    # fcntl is POSIX-only: imported here so that the package still imports
    # where it is missing (only building a cache needs the lock).
    import fcntl  # noqa: PLC0415

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
