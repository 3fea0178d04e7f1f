"""``gefen_titan.distributed.layout``: the box of a parameter each rank holds, pinned against real shards.

Every layout the trainer makes, made the way the trainer makes it, on a fake
process group (``torch.testing._internal.distributed.fake_pg``: this process
plays each rank in turn; FSDP2's, TP's and EP's own cutting run as in a job,
with no peers): the parameter starts as ``arange`` (each element its own
global index), so a rank's local tensor says which elements it holds, and
``param_box`` / ``local_box`` must name exactly those, in their order.

* dense: FSDP2 (even, uneven, empty shards), TP colwise and rowwise, FSDP2
  over TP (``_StridedShard``, even and uneven), HSDP;
* mixture of experts, through torchtitan 0.3.0's own ``ParallelDims`` and
  ``apply_fsdp_to_decoder`` (the experts first cut by EP ``Shard(0)`` on
  ``ep``, as its parallelize does): EP alone, EP x efsdp ``Shard(0)`` even
  and uneven (empty shards), efsdp ``Shard(1)`` (efsdp x ep > experts) with
  and without EP, HSDP with EP;
* pipeline stages: a parameter on its stage's sub-mesh.

Each case also checks what DCP would write (``dcp_disagreement``: DTensor's
own offsets), every element held once per copy, and ``copy_groups``.
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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from gefen_titan import patches
from gefen_titan.distributed import layout as L

patches.apply_all()  # ParallelDims' meshes on CPU
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def arange(shape) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)


def check_ranks(shape, weights: list[torch.Tensor], copies: int, dcp_agrees: bool = True) -> list[L.Box]:
    """Each rank's local tensor is ``full[box]`` of the box the layout names; every element is held
    ``copies`` times; DCP's view (DTensor's offsets) agrees or not as expected."""
    full = arange(shape)
    seen = torch.zeros(full.numel(), dtype=torch.int64)
    boxes = []
    for rank, (w, box, disagreement, _) in enumerate(weights):
        local = w.to_local() if isinstance(w, DTensor) else w
        assert box.sizes == tuple(local.shape), (rank, box, tuple(local.shape))
        assert torch.equal(local, full[box.slices()]), (rank, box)
        seen.index_add_(0, local.reshape(-1).long(), torch.ones(local.numel(), dtype=torch.int64))
        assert (disagreement is None) == dcp_agrees, (rank, disagreement)
        boxes.append(box)
    assert bool((seen == copies).all()), seen
    return boxes


def observed(w: torch.Tensor) -> tuple[torch.Tensor, L.Box, str | None, tuple[int, ...] | None]:
    """What the layout module says of ``w`` on the playing rank (taken while its process group is up)."""
    return w, L.local_box(w), L.dcp_disagreement("w", w), L.mesh_coordinate(w.device_mesh)


# ------------------------------------------------------------------ dense layouts
def linear_weight(shape, mesh_shape, names, rank, *, tp_style=None, fsdp_dims=None) -> tuple:
    with fake_rank(rank, math.prod(mesh_shape)):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        lin = nn.Linear(shape[1], shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(arange(shape))
        model = nn.Sequential(lin)
        if tp_style is not None:
            parallelize_module(model, mesh["tp"], {"0": tp_style()}, src_data_rank=None)  # each rank cuts its own
        if fsdp_dims is not None:
            fully_shard(model, mesh=mesh[fsdp_dims] if len(fsdp_dims) > 1 else mesh[fsdp_dims[0]])
        return observed(model[0].weight)


DENSE = [
    pytest.param((8, 6), (4,), ("dp",), None, ("dp",), 1, id="fsdp4"),
    pytest.param((10, 6), (4,), ("dp",), None, ("dp",), 1, id="fsdp4-uneven"),  # 3, 3, 3, 1 rows
    pytest.param((2, 6), (3,), ("dp",), None, ("dp",), 1, id="fsdp3-empty-shard"),  # 1, 1, 0 rows
    pytest.param((6, 10), (3,), ("tp",), RowwiseParallel, None, 1, id="tp3-rowwise-uneven"),  # 4, 4, 2 columns
    pytest.param((9, 4), (2,), ("tp",), ColwiseParallel, None, 1, id="tp2-colwise-uneven"),
    pytest.param((10, 6), (2, 2), ("dp", "tp"), ColwiseParallel, ("dp",), 1, id="fsdp2xtp2-uneven"),
    pytest.param((24, 4), (2, 4), ("dp", "tp"), ColwiseParallel, ("dp",), 1, id="fsdp2xtp4"),
    pytest.param((10, 10), (3, 2), ("dp", "tp"), RowwiseParallel, ("dp",), 1, id="fsdp3xtp2-rowwise-uneven"),
    pytest.param((11, 6), (2, 2), ("rep", "dp"), None, ("rep", "dp"), 2, id="hsdp2x2-uneven"),
]


@pytest.mark.parametrize("shape, mesh_shape, names, tp_style, fsdp_dims, copies", DENSE)
def test_dense_layouts_are_the_shards_the_trainer_holds(shape, mesh_shape, names, tp_style, fsdp_dims, copies):
    held = [linear_weight(shape, mesh_shape, names, r, tp_style=tp_style, fsdp_dims=fsdp_dims)
            for r in range(math.prod(mesh_shape))]
    check_ranks(shape, held, copies)


def test_fsdp2_over_tp_at_an_uneven_cut_is_fsdp2s_and_dcp_would_misplace_it():
    """7 rows, TP 2 (4 + 3), FSDP 3: FSDP2 holds row 6 on coordinate (2, 1), where DTensor (and so
    DCP's offsets) put it on (2, 0). The layout follows FSDP2; ``dcp_disagreement`` names the two
    ranks whose checkpoint chunks would be wrong."""
    shape = (7, 4)
    held = [linear_weight(shape, (3, 2), ("dp", "tp"), r, tp_style=ColwiseParallel, fsdp_dims=("dp",))
            for r in range(6)]
    assert tuple(held[0][0].placements) == (_StridedShard(0, split_factor=2), Shard(0))
    full = arange(shape)
    for w, box, *_ in held:
        assert torch.equal(w.to_local(), full[box.slices()])
    assert [box.sizes[0] for _, box, *_ in held] == [2, 1, 2, 1, 0, 1]
    assert [d is not None for _, _, d, _ in held] == [False, False, False, False, True, True]
    assert "shape (1, 4)" in held[4][2] and "shape (0, 4)" in held[5][2]


# -------------------------------------------------------------- mixture of experts
class _Experts(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.num_experts = shape[0]
        self.w1 = nn.Parameter(arange(shape))


class _Block(nn.Module):
    """What torchtitan's apply_fsdp_to_decoder reads of an MoE block: ``moe_enabled`` and
    ``moe.routed_experts.inner_experts`` (its parameters and ``num_experts``)."""

    moe_enabled = True

    def __init__(self, shape):
        super().__init__()
        self.moe = nn.Module()
        self.moe.routed_experts = nn.Module()
        self.moe.routed_experts.inner_experts = _Experts(shape)
        self.moe.gate = nn.Linear(shape[2], shape[0], bias=False)


class _Decoder(nn.Module):
    enable_weight_tying = False

    def __init__(self, shape):
        super().__init__()
        self.tok_embeddings = self.norm = self.lm_head = None
        self.layers = nn.ModuleDict({"0": _Block(shape)})


def expert_weight(shape, world, rank, *, ep, rep=1, pp=1):
    """The routed experts' weight on ``rank`` as torchtitan 0.3.0 shards it: EP's ``Shard(0)`` on
    ``ep`` (its parallelize), then its ``apply_fsdp_to_decoder`` (efsdp, Shard(0) or Shard(1))."""
    with fake_rank(rank, world):
        dims = ParallelDims(dp_replicate=rep, dp_shard=world // (rep * pp), cp=1, tp=1, pp=pp, ep=ep,
                            world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        model = _Decoder(shape)
        experts = model.layers["0"].moe.routed_experts.inner_experts
        rep_names = ["dp_replicate"] if rep > 1 else []
        edp = None
        if ep > 1:
            experts.w1 = nn.Parameter(distribute_tensor(experts.w1.data, dims.get_mesh("ep"), [Shard(0)],
                                                        src_data_rank=None))
            edp = dims.get_optional_mesh(rep_names + ["efsdp"])
        dp = dims.get_mesh(rep_names + ["fsdp"])
        apply_fsdp_to_decoder(model, dp, torch.float32, torch.float32, pp > 1, ep_degree=ep, edp_mesh=edp)
        return observed(experts.w1)


MOE = [
    # (experts, rows, cols), world, ep, rep, the experts' placements, copies
    pytest.param((8, 4, 4), 2, 2, 1, (_StridedShard(0, split_factor=2), Shard(0)), 1, id="ep2"),
    pytest.param((8, 4, 4), 4, 4, 1, (_StridedShard(0, split_factor=4), Shard(0)), 1, id="ep4"),
    pytest.param((8, 4, 4), 4, 2, 1, (_StridedShard(0, split_factor=2), Shard(0)), 1, id="ep2xefsdp2"),
    pytest.param((8, 4, 4), 6, 2, 1, (_StridedShard(0, split_factor=2), Shard(0)), 1, id="ep2xefsdp3-empty"),
    pytest.param((2, 4, 6), 4, 2, 1, (Shard(1), Shard(0)), 1, id="ep2xefsdp2-shard1"),
    pytest.param((2, 12, 4), 6, 2, 1, (Shard(1), Shard(0)), 1, id="ep2xefsdp3-shard1"),
    pytest.param((2, 8, 4), 4, 1, 1, (Shard(1),), 1, id="ep1xfsdp4-shard1"),
    pytest.param((8, 4, 4), 2, 1, 1, (Shard(0),), 1, id="ep1xfsdp2"),
    pytest.param((8, 4, 4), 8, 2, 2, (Replicate(), _StridedShard(0, split_factor=2), Shard(0)), 2,
                 id="hsdp2-ep2xefsdp2"),
]


@pytest.mark.parametrize("shape, world, ep, rep, placements, copies", MOE)
def test_expert_layouts_are_the_shards_torchtitan_makes(shape, world, ep, rep, placements, copies):
    held = [expert_weight(shape, world, r, ep=ep, rep=rep) for r in range(world)]
    assert {tuple(w.placements) for w, *_ in held} == {placements}
    boxes = check_ranks(shape, held, copies)
    if ep > 1:
        # EP cuts whole experts first: every rank's experts lie in its own EP shard's range.
        per_ep = shape[0] // ep
        for (_, _, _, coord), box in zip(held, boxes):
            ep_coord = coord[-1]
            assert box.sizes[0] == 0 or per_ep * ep_coord <= box.offsets[0] < box.offsets[0] + box.sizes[0] \
                <= per_ep * (ep_coord + 1), (ep_coord, box)


def test_experts_under_efsdp_shard1_cut_rows_of_whole_experts():
    """efsdp x ep > experts: torchtitan's FSDP cuts the experts' rows (``Shard(1)``), each EP rank
    keeping its own experts; an expert's rows then lie on several ranks (GefenMuon's exchange
    assembles them)."""
    held = [expert_weight((2, 4, 6), 4, r, ep=2) for r in range(4)]
    boxes = [box for _, box, *_ in held]
    assert [b.sizes for b in boxes] == [(1, 2, 6)] * 4
    assert sorted((b.offsets[0], b.offsets[1]) for b in boxes) == [(0, 0), (0, 2), (1, 0), (1, 2)]


# ----------------------------------------------------------------- pipeline stages
def stage_weight(rank: int):
    """PP 2 x FSDP 2: each stage's weight (its own values) sharded on its stage's ``dp`` sub-mesh."""
    with fake_rank(rank, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage = rank // 2
        lin = nn.Linear(4, 6, bias=False)
        with torch.no_grad():
            lin.weight.copy_(arange((6, 4)) + 100 * stage)
        model = nn.Sequential(lin)
        fully_shard(model, mesh=mesh["dp"])
        w = model[0].weight
        groups = L.copy_groups(w)
        return w, L.local_box(w), L.dcp_disagreement("w", w), groups, stage


def test_pipeline_stages_place_on_their_sub_mesh():
    for rank in range(4):
        w, box, disagreement, groups, stage = stage_weight(rank)
        assert disagreement is None
        assert box.sizes == (3, 4) and box.offsets == (3 * (rank % 2), 0)
        assert torch.equal(w.to_local(), (arange((6, 4)) + 100 * stage)[box.slices()])
        # One copy, its members the stage's ranks, in the order of their coordinates.
        assert [[r for r, _ in g] for g in groups] == [[2 * stage, 2 * stage + 1]]


# ---------------------------------------------------------------- the pure pieces
def test_chunk_is_torch_chunk():
    for n in range(0, 12):
        for parts in range(1, 6):
            pieces = torch.arange(n).chunk(parts) if n else ()
            for i in range(parts):
                start, size = L.chunk(0, n, parts, i)
                want = pieces[i].tolist() if i < len(pieces) else []
                assert list(range(start, start + size)) == want, (n, parts, i)


def test_flat_run():
    shape = (4, 3, 5)
    assert L.Box((1, 0, 0), (2, 3, 5)).flat_run(shape) == (15, 30)  # whole rows of dim 0
    assert L.Box((2, 1, 0), (1, 2, 5)).flat_run(shape) == (35, 10)  # one expert, some rows
    assert L.Box((0, 1, 0), (2, 2, 5)).flat_run(shape) is None  # rows of two experts: two runs
    assert L.Box((0, 0, 1), (1, 1, 3)).flat_run(shape) == (1, 3)
    assert L.Box((0, 0, 0), (4, 3, 2)).flat_run(shape) is None  # a column cut
    assert L.Box((3, 0, 0), (0, 3, 5)).flat_run(shape) == (0, 0)


def test_a_strided_shard_that_is_no_fsdp2_cut_is_refused():
    with pytest.raises(L.LayoutError, match="split_factor=3"):
        L.shard_box((8, 4), (2, 2), (_StridedShard(0, split_factor=3), Shard(0)), (0, 0))
    with pytest.raises(L.LayoutError, match="only Shard"):
        L.shard_box((8, 4), (2,), (Partial(),), (0,))


def test_leading_and_front_counted_placements():
    with fake_rank(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        w = DTensor.from_local(torch.zeros(2, 4, 6), mesh, (Shard(1), Shard(0)), run_check=False,
                               shape=(4, 8, 6), stride=(48, 6, 1))
        assert L.leading_placements(w, 2) == (Shard(1), Shard(0))
        assert L.leading_placements(w, 1) == (Replicate(), Shard(0))
        v = DTensor.from_local(torch.zeros(4, 3), mesh, (Shard(-1), Shard(0)), run_check=False,
                               shape=(8, 6), stride=(6, 1))
        assert L.placements_from_front(v) == (Shard(1), Shard(0))
        assert L.leading_placements(v, 1) == (Replicate(), Shard(0))


def test_the_optimizer_refuses_a_shard_dcp_would_misplace_before_its_first_step():
    """FSDP 3 x TP 2 at 7 rows on the rank DCP would misplace: agreed blocking's first error check
    refuses it (on every rank: it is one of the check's verdicts), before Gefen learns anything."""
    from gefen_titan.optim import gefenx as gx
    from gefen_titan.optim.block_periods import BlockingError
    from gefen_titan.optim.container import GefenOptimizersContainer

    with fake_rank(5, 6):
        mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))
        model = nn.Sequential(nn.Linear(4, 7, bias=False))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()}, src_data_rank=None)
        fully_shard(model, mesh=mesh["dp"])
        w = model[0].weight
        w.grad = DTensor.from_local(torch.ones_like(w.to_local()), w.device_mesh, w.placements,
                                    run_check=False, shape=w.shape, stride=w.stride())
        opt = GefenOptimizersContainer.Config(name="Gefen", lr=1e-2).build(model_parts=[model])
        before = w.to_local().clone()
        with pytest.raises(BlockingError, match="0.weight: this rank holds .* a checkpoint would store"):
            opt.step()
        (optim,) = opt.optimizers_of("Gefen")
        assert gx.codebook(optim) is None and torch.equal(w.to_local(), before)
