"""``optim.muon.matrices.shard_indices``: the global rows and columns each rank's shard of a GefenMuon matrix holds.

The sharded step takes them as the truth about what every member of a shard
group holds (it gathers the shards into the matrix by them and sends each
member its slice of the update back), and it checks only the shape of its
own. So these tests compare them, value by value, with real shards: this
process plays each rank of a 1-, 2- or 3-D mesh in turn on a fake process
group (``torch.testing._internal.distributed.fake_pg``: no peers, so
DTensor's split with ``src_data_rank=None`` and FSDP2's and TP's own
chunking run as on a real job, without communication), shards ``arange``
(each element its own global index) and checks that ``shard_indices`` picks
out exactly the elements the rank holds, for uneven cuts too. The
multi-rank step is tests/integration/test_gefen_muon.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from gefen_titan.optim.muon.matrices import shard_indices


@contextlib.contextmanager
def as_rank(rank: int, mesh_shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """This process as ``rank`` of a job on a CPU mesh of ``mesh_shape`` (a fake process group)."""
    dist.init_process_group("fake", rank=rank, world_size=math.prod(mesh_shape), store=FakeStore())
    try:
        yield init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def held(full: torch.Tensor, shape, mesh_shape, placements, coord) -> torch.Tensor:
    rows, cols = shard_indices(tuple(shape), tuple(mesh_shape), placements, tuple(coord))
    return full[rows][:, cols]


def fsdp_tp(tp: int) -> tuple:
    """FSDP2's placements over TP's colwise ``Shard(0)``: rows cut by TP, then each TP shard by FSDP."""
    return (_StridedShard(0, split_factor=tp), Shard(0))


# Every layout the trainer gives a matrix, even and uneven: (shape, mesh shape, placements).
LAYOUTS = [
    pytest.param((8, 6), (4,), (Shard(0),), id="fsdp4"),
    pytest.param((10, 6), (4,), (Shard(0),), id="fsdp4-uneven"),  # 3, 3, 3, 1 rows
    pytest.param((6, 10), (3,), (Shard(1),), id="tp3-rowwise-uneven"),  # 4, 4, 2 columns
    pytest.param((8, 6), (2, 2), fsdp_tp(2), id="fsdp2xtp2"),
    pytest.param((10, 6), (2, 2), fsdp_tp(2), id="fsdp2xtp2-uneven"),
    # FSDP 3 x TP 2 at 13 or 7 rows: DTensor's own _StridedShard split differs from what FSDP2 holds;
    # shard_indices follows FSDP2 (the trainer's shards): test_fsdp2_over_tp_at_an_uneven_cut below.
    pytest.param((24, 4), (2, 4), fsdp_tp(4), id="fsdp2xtp4"),
    pytest.param((12, 10), (2, 2), (Shard(0), Shard(1)), id="fsdp2xtp2-rowwise"),
    pytest.param((16, 6), (2, 2, 2), (Replicate(), *fsdp_tp(2)), id="hsdp2x2xtp2"),
    pytest.param((11, 6), (2, 2, 2), (Replicate(), *fsdp_tp(2)), id="hsdp2x2xtp2-uneven"),
]


@pytest.mark.parametrize("shape, mesh_shape, placements", LAYOUTS)
def test_shard_indices_are_the_elements_dtensor_gives_each_rank(shape, mesh_shape, placements):
    """Pins ``shard_indices`` (``_StridedShard`` above all) against DTensor's own sharding: on every rank,
    ``distribute_tensor`` of ``arange`` with the placements holds exactly the elements at the indices
    ``shard_indices`` gives for the rank's mesh coordinate, in their order."""
    full = torch.arange(math.prod(shape)).reshape(shape)
    seen = torch.zeros(full.numel(), dtype=torch.int64)
    for rank in range(math.prod(mesh_shape)):
        with as_rank(rank, mesh_shape) as mesh:
            coord = tuple(mesh.get_coordinate())
            local = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        assert torch.equal(local, held(full, shape, mesh_shape, placements, coord)), (rank, coord)
        seen.index_add_(0, local.reshape(-1), torch.ones(local.numel(), dtype=torch.int64))
    copies = math.prod(n for n, pl in zip(mesh_shape, placements) if pl.is_replicate())
    assert bool((seen == copies).all())  # every element once per copy of the matrix


# FSDP2 (``fully_shard``) over TP (``parallelize_module``), as torchtitan applies them; sizes where
# FSDP2's cut of each TP shard is the one its placements describe.
TRAINER = [
    pytest.param((8, 6), 2, 2, ColwiseParallel, id="colwise-fsdp2xtp2"),
    pytest.param((10, 6), 2, 2, ColwiseParallel, id="colwise-fsdp2xtp2-uneven"),  # TP 5 + 5, each FSDP 3 + 2
    pytest.param((9, 4), 2, 2, ColwiseParallel, id="colwise-fsdp2xtp2-uneven-tp"),  # TP 5 + 4
    pytest.param((24, 4), 2, 4, ColwiseParallel, id="colwise-fsdp2xtp4"),
    pytest.param((12, 10), 2, 2, RowwiseParallel, id="rowwise-fsdp2xtp2"),
    pytest.param((10, 10), 3, 2, RowwiseParallel, id="rowwise-fsdp3xtp2-uneven"),  # FSDP: rows 4 + 4 + 2
]


def fsdp_tp_weight(shape, dp: int, tp: int, style, rank: int):
    """Rank ``rank``'s (mesh coordinate, FSDP2 x TP weight) of an ``nn.Linear`` whose weight is ``arange``."""
    with as_rank(rank, (dp, tp), ("dp", "tp")) as mesh:
        lin = nn.Linear(shape[1], shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape))
        model = nn.Sequential(lin)
        parallelize_module(model, mesh["tp"], {"0": style()}, src_data_rank=None)  # each rank cuts its own
        fully_shard(model, mesh=mesh["dp"])
        return tuple(mesh.get_coordinate()), model[0].weight


@pytest.mark.parametrize("shape, dp, tp, style", TRAINER)
def test_shard_indices_are_the_elements_fsdp2_over_tp_holds(shape, dp, tp, style):
    """Pins ``shard_indices`` against the trainer's own shards: FSDP2 over TP (``_StridedShard`` on the
    data-parallel dim for colwise TP) holds, on every rank, exactly the weight's elements at the indices
    ``shard_indices`` gives from the DTensor's placements."""
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    for rank in range(dp * tp):
        coord, w = fsdp_tp_weight(shape, dp, tp, style, rank)
        if style is ColwiseParallel:
            assert tuple(w.placements) == fsdp_tp(tp)
        assert torch.equal(w.to_local(), held(full, shape, (dp, tp), w.placements, coord)), (rank, coord)


@pytest.mark.parametrize("rows", [7, 13])
def test_fsdp2_over_tp_at_an_uneven_cut(rows):
    """7 rows, TP 2 (4 + 3), FSDP 3: FSDP2 holds rows [], [6] at coordinates (2, 0), (2, 1), where
    DTensor's own split of the same placements says [6], []: ``shard_indices`` replays FSDP2's cuts
    (TP first, then a chunk of each TP shard), the layout the trainer's parameters have."""
    shape = (rows, 4)
    full = torch.arange(rows * 4, dtype=torch.float32).reshape(shape)
    for rank in range(6):
        coord, w = fsdp_tp_weight(shape, 3, 2, ColwiseParallel, rank)
        assert torch.equal(w.to_local(), held(full, shape, (3, 2), w.placements, coord)), (rank, coord)
