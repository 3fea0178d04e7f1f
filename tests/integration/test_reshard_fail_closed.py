"""Bad Gefen checkpoints (format v1) fail closed: every rank raises the same
clear error (no rank hangs) and the live optimizer is exactly as it was.

One 2-rank job (``reshard_worker``'s corrupt mode, in the last launch of
``tests.helpers.reshard_runs``) tries every bad checkpoint of
``bad_checkpoints.V1_CASES`` in turn on a stepped optimizer: edits of the
2-rank run's checkpoint, a missing and a cut-short data file, and another
optimizer's (AdamW's) checkpoint of the same model.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.bad_checkpoints import V1_CASES
from tests.helpers.reshard_analysis import load_run


@pytest.fixture(scope="module")
def results(runs):
    base, _ = runs
    return load_run(str(base / "bad" / "out"), "corrupt", 2)


@pytest.mark.parametrize("case", sorted(V1_CASES))
def test_bad_checkpoint_fails_closed_on_every_rank(results, case):
    expected = V1_CASES[case][1]
    for rank in results:
        got = rank["cases"][case]
        assert got["error"] is not None, f"{case}: load succeeded on rank {rank['rank']}"
        assert "GefenCheckpointError" in got["error"], got["error"]
        assert expected in got["error"], got["error"]
        before, after = got["before"], got["after"]
        assert before.keys() == after.keys()
        for name, rec in before.items():
            for key, value in rec.items():
                other = after[name][key]
                same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                assert same, f"{case}: live {name}.{key} changed by a failed load"
    # Every rank got the same message.
    assert len({rank["cases"][case]["error"] for rank in results}) == 1


def test_foreign_optimizer_error_says_what_to_do(results):
    assert "exclude_from_loading" in results[0]["cases"]["adamw"]["error"]
