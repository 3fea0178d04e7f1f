"""The checkpoint manager's save and load lines (``checkpoint.log_lines``) on metadata of several ranks."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from gefen_titan.checkpoint import log_lines


def _metadata(ranks: int) -> Metadata:
    """``w`` (8 x 4) cut by rows over ``ranks`` writers, each rank's data file its own."""
    rows = 8 // ranks
    chunks = [ChunkStorageMetadata(offsets=torch.Size([r * rows, 0]), sizes=torch.Size([rows, 4]))
              for r in range(ranks)]
    storage = {MetadataIndex("w", torch.Size([r * rows, 0])): SimpleNamespace(relative_path=f"__{r}_0.distcp")
               for r in range(ranks)}
    sd = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 4]), chunks)}
    return Metadata(state_dict_metadata=sd, storage_data=storage)


def test_the_saved_side_counts_writers_and_the_step_comes_from_the_folder():
    assert log_lines.written_by(_metadata(4)) == 4
    assert log_lines.step_of("/x/checkpoint/step-12/") == "12" and log_lines.step_of("/x/other") == "other"
    line = log_lines.loading("/x/checkpoint/step-12", _metadata(4), {"w": torch.zeros(8, 4)}, 2)
    assert line == "Loading step 12 from /x/checkpoint/step-12: saved by 4 ranks, loading onto 2 ranks"
    assert log_lines.loading("/x/step-1", None, {}, 1) == "Loading step 1 from /x/step-1: onto 1 rank"


def test_the_saved_line_names_the_bytes(tmp_path):
    step = tmp_path / "step-5"
    step.mkdir()
    (step / "__0_0.distcp").write_bytes(b"x" * 1_500_000)
    (step / ".metadata").write_bytes(b"y" * 200_000)
    assert log_lines.saved(step, 0.25) == f"Saved step 5 to {step}: 1.7 MB in 0.25 s"


def _run_logs(tmp_path, caplog) -> list[str]:
    from tests.helpers import tiny_checkpoint

    caplog.clear()
    with caplog.at_level(logging.INFO):
        tiny_checkpoint.save(tmp_path)
        tiny_checkpoint.resume(tmp_path)
    return [r.getMessage() for r in caplog.records]


def test_torchtitans_bare_save_and_load_lines_give_way_to_ours(tmp_path, caplog, monkeypatch):
    """A save and a resume through the manager log ours, not torchtitan's bare lines; with the filter
    taken off, torchtitan's come back (so a rewording in torchtitan fails here, loudly)."""
    root = logging.getLogger()
    try:
        lines = _run_logs(tmp_path / "a", caplog)
        assert any(m.startswith("Saved step 1 to ") for m in lines), lines
        assert any(m.startswith("Loading step 1 from ") for m in lines), lines
        assert "Saving the checkpoint." not in lines
        assert not any(m.startswith("Loading the checkpoint from ") for m in lines), lines
        for f in [f for f in root.filters if isinstance(f, log_lines.SupersededLines)]:
            root.removeFilter(f)
        monkeypatch.setattr(log_lines.SupersededLines, "filter", lambda self, record: True)  # installed again
        lines = _run_logs(tmp_path / "b", caplog)
        assert "Saving the checkpoint." in lines
        assert any(m.startswith("Loading the checkpoint from ") for m in lines), lines
    finally:
        for f in [f for f in root.filters if isinstance(f, log_lines.SupersededLines)]:
            root.removeFilter(f)
