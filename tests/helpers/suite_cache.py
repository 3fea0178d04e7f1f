"""Where the suite keeps what its tests share across processes.

Run in parallel workers (pytest-xdist's ``-n``: the README runs the unit
tier so; the integration tier runs in one process there, but may be run in
workers too), each worker has a temp folder of its own
(``.../pytest-N/popen-gwK``), but the CI reference runs are worth sharing
across workers, so their cache is the run's common folder
(``.../pytest-N``). ``gefen_titan.validation.runs.reference_run`` locks each
cached run, so two workers asking for the same run train it once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["reference_cache"]


def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite run's cache of CI reference runs, shared by its workers."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return base / "reshard_reference_cache"
