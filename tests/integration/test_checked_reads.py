"""The checking reader's refusals are collective: every rank raises the same error and none hangs.

The reader makes no collective of its own: whether every rank found
``.digests`` travels with DCP's planning round, a damaged item's refusal
with DCP's gather after the read step. This is what keeps a load from
hanging with one rank refused; a rank whose own bytes are intact has
written its (fresh) targets by then, which is why no caller hands the
reader live ones; the 2-rank resume of a real recipe with
flipped bytes, whose live model and optimizer must stay as they were, is
``test_checkpoint_integrity.py``.
"""

import json

from tests.helpers import processes
from tests.helpers.checked_reads_worker import checked_reads


def test_refusals_reach_every_rank(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    processes.run_ranks(2, checked_reads, [str(tmp_path), str(out)], logs=tmp_path / "logs", timeout=300)
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert seen[r]["good"] == {"loaded": True, "untouched": False}, seen[r]["good"]
    for case, words in (("disagree", "ranks disagree whether"), ("blind", "simulated: .digests is unreadable"),
                        ("damaged", "__1_0.distcp")):
        errors = {s[case].get("error") for s in seen}
        assert not any(s[case]["loaded"] for s in seen), (case, seen)
        assert len(errors) == 1 and words in errors.pop(), (case, seen)
    for case in ("disagree", "blind"):  # refused in the planning round: nothing read
        assert seen[0][case]["untouched"] and seen[1][case]["untouched"], (case, seen)
    assert "digest mismatch" in seen[0]["damaged"]["error"] and seen[1]["damaged"]["untouched"]
