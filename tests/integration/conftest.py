"""Set-up shared by the multi-process tests."""

from pathlib import Path

import pytest

from tests.helpers import moe_runs, reshard_runs, worker_jobs


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """The runs of ``tests.helpers.reshard_runs`` (format v1, with the
    fail-closed jobs of test_reshard_fail_closed.py): (base folder, outputs)."""
    base = tmp_path_factory.mktemp("reshard")
    worker_jobs.launch_all(reshard_runs.plan(base), base / "logs")
    return base, base / "out"


@pytest.fixture(scope="session")
def moe_launch(tmp_path_factory) -> Path:
    """Every job of ``moe_runs.plan`` (test_moe.py's and test_factored.py's MoE runs, in shared launches):
    the outputs."""
    base = tmp_path_factory.mktemp("moe")
    worker_jobs.launch_all(moe_runs.plan(base), base / "logs")
    return base / "out"
