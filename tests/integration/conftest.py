"""Set-up shared by the torchrun tests."""

import pytest

from tests.helpers.reshard_runs import run_all


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The reshard runs of ``tests.helpers.reshard_runs`` (format v1): (base folder, outputs)."""
    base = tmp_path_factory.mktemp("reshard")
    return base, run_all(base)
