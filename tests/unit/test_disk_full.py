"""A full disk during a save (issue 38, item 6), synchronous and async.

One process, one gloo rank (``keep_latest_k`` purges on rank 0 of a process
group), the tiny checkpoint of ``tests.helpers.tiny_checkpoint`` saved by
GefenCheckpointManager. The disk fills part-way through a save: every file
DCP's writer opens (``FileSystem.create_stream``) shares a budget of bytes,
and the write that crosses it raises ``OSError(ENOSPC)``, as a full file
system does. Then:

* the save (sync) or the wait for it (async) raises one
  ``GefenCheckpointError`` saying the disk is full and what to do;
* the failed folder has no ``.metadata``, so the resume takes the previous
  checkpoint, which loads;
* ``keep_latest_k`` (2, torchtitan's least) never purges the newest complete
  checkpoint for incomplete ones: with failed ``step-4`` and ``step-5``
  left behind, saving a complete ``step-3`` keeps ``step-3`` (torchtitan's
  purge counted the failed folders as the two newest and deleted both
  complete ones: the sync test fails with it); in the async test, ``step-2``
  survives the purge that runs while ``step-5`` is in flight.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from gefen_titan.checkpoint.errors import GefenCheckpointError
from tests.helpers.tiny_checkpoint import build, manager

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Full:
    """A write stream of a file system with ``budget[0]`` bytes left."""

    def __init__(self, stream, budget: list[int], path) -> None:
        self._stream, self._budget, self._path = stream, budget, str(path)

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._budget[0]:
            self._stream.write(memoryview(data).cast("B")[:self._budget[0]])
            self._budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
        self._budget[0] -= n
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def disk_full_after(monkeypatch, nbytes: int):
    budget = [nbytes]
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield _Full(stream, budget, path) if "w" in mode else stream

    with monkeypatch.context() as m:
        m.setattr(FileSystem, "create_stream", create_stream)
        yield


def _save(root: Path, step: int, **config) -> None:
    net, opt = build(0)
    for _ in range(step):
        net(torch.randn(4, 16)).square().mean().backward()
        opt.step()
    m = manager(root, net, opt, step=step, keep_latest_k=2, **config)
    try:
        m.save(curr_step=step)
        m.maybe_wait_for_saving()
    finally:
        m.close()


def _latest(root: Path) -> int:
    net, opt = build(5)
    m = manager(root, net, opt)
    assert m.load()
    return m.states["train_state"].step


def test_a_sync_save_that_fills_the_disk(tmp_path, monkeypatch, one_rank):
    _save(tmp_path, 2)
    for step in (4, 5):
        with disk_full_after(monkeypatch, 4000), pytest.raises(GefenCheckpointError, match=(
                rf"checkpoint save to .*step-{step} failed: no space left on device .*the last complete checkpoint "
                "still loads")):
            _save(tmp_path, step)
        assert not (tmp_path / "ckpt" / f"step-{step}" / ".metadata").exists()
    assert _latest(tmp_path) == 2  # a failed folder is never taken as the latest
    _save(tmp_path, 3)  # space again (a resume from step 2 saves step 3), the failed folders still there
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-3", "step-4", "step-5"]
    assert _latest(tmp_path) == 3


def test_an_async_save_that_fills_the_disk(tmp_path, monkeypatch, one_rank):
    _save(tmp_path, 2, async_mode="async")
    for step in (4, 5):  # step 5's purge runs while it is in flight, with the failed step-4 beside it
        with disk_full_after(monkeypatch, 4000), pytest.raises(GefenCheckpointError, match=(
                r"checkpoint save to .*failed: no space left on device")):
            _save(tmp_path, step, async_mode="async")  # raised where the save is waited for
        assert not (tmp_path / "ckpt" / f"step-{step}" / ".metadata").exists()
    assert (tmp_path / "ckpt" / "step-2" / ".metadata").exists()  # not purged for the failed ones
    assert _latest(tmp_path) == 2
