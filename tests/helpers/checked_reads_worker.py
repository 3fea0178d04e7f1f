"""The checking reader's collective paths on 2 ranks: every refusal on both ranks, no hang, nothing live written.

``checked_reads(argv)`` runs on every rank (``processes.run_ranks``):
``FOLDER OUT``. Rank 0 saves a small sharded state (a DTensor row-sharded
over the 2 ranks, a raw Gefen-style entry, a replicated tensor) through
``storage.storage_writer``; copies of it are then loaded in four ways that
must each be refused on both ranks with the same error:

* ``disagree``: rank 1's reader is told the checkpoint has no ``.digests``
  (as if it saw other files), rank 0's reads them;
* ``blind``: rank 1 cannot read ``.digests`` (an OSError);
* ``damaged``: rank 1's data file has a flipped byte; rank 0's own bytes
  are intact, and DCP's own gather after the read step raises rank 1's
  refusal on rank 0 too (rank 0 has written its targets by then: the
  reason every caller hands the reader fresh ones).

Each rank writes what it saw to ``OUT/rank{r}.json``; the test judges.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from gefen_titan.checkpoint.io import storage
from gefen_titan.checkpoint.io.reading import CheckedFileSystemReader

SENTINEL = -7.0


class _Blind(CheckedFileSystemReader):
    """A reader whose file system fails to read ``.digests`` (one rank's storage trouble)."""

    def digests(self):
        raise OSError("simulated: .digests is unreadable from this rank")


def _state(mesh, fill: float | None) -> dict:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 8, generator=g)
    codes = torch.randint(0, 255, (16, 8), dtype=torch.uint8, generator=g)
    if fill is not None:
        w, codes = torch.full_like(w, fill), torch.zeros_like(codes)
    return {"model.w": distribute_tensor(w, mesh, [Shard(0)]),
            "optimizer.gefen/qcodes/w": distribute_tensor(codes, mesh, [Shard(0)]),
            "bias": distribute_tensor(torch.full((4,), fill if fill is not None else 2.5), mesh, [Replicate()])}


def _attempt(make_reader, mesh) -> dict:
    sd = _state(mesh, SENTINEL)
    try:
        dcp.load(sd, storage_reader=make_reader())
        verdict = {"loaded": True}
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        verdict = {"loaded": False, "error": str(storage.refusal("ckpt", e))}
    local = sd["model.w"].to_local() if isinstance(sd["model.w"], DTensor) else sd["model.w"]
    verdict["untouched"] = bool((local == SENTINEL).all())
    return verdict


def checked_reads(argv: list[str]) -> None:
    folder, out = argv
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        good = os.path.join(folder, "good")
        dcp.save(_state(mesh, None), storage_writer=storage.storage_writer(good))
        damaged = os.path.join(folder, "damaged")
        if rank == 0:
            shutil.copytree(good, damaged)
            data = bytearray(open(os.path.join(damaged, "__1_0.distcp"), "rb").read())
            data[len(data) // 2] ^= 0x5A
            open(os.path.join(damaged, "__1_0.distcp"), "wb").write(bytes(data))
        dist.barrier()
        md = storage.read_metadata(good)
        lacking = {"digests": None} if rank else {}  # rank 1 "sees" no .digests
        seen = {
            "good": _attempt(lambda: storage.storage_reader(good), mesh),
            "disagree": _attempt(lambda: storage.storage_reader(good, metadata=md, **lacking), mesh),
            "blind": _attempt(lambda: _Blind(good) if rank else storage.storage_reader(good), mesh),
            "damaged": _attempt(lambda: storage.storage_reader(damaged), mesh),
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
    finally:
        dist.destroy_process_group()
