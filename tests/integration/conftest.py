"""Set-up shared by the multi-process tests."""

from pathlib import Path

import pytest

from tests.helpers import reshard_runs, worker_jobs


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """The runs of ``tests.helpers.reshard_runs`` (format v1, with the
    fail-closed jobs of test_reshard_fail_closed.py): (base folder, outputs)."""
    base = tmp_path_factory.mktemp("reshard")
    worker_jobs.launch_all(reshard_runs.plan(base), base / "logs")
    return base, base / "out"
