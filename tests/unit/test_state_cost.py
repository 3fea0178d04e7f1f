"""Each optimizer kind's state cost lives on its registry entry, and whoever counts state asks the entry.

* Every registered rule (``OptimizerSpec.cost``: Gefen, GefenMuon, AdamW, Adam) is what the real optimizer
  holds after a step on a tiny model, per parameter and per optimizer (``optim.state_size``'s count).
* ``optim.state_size`` counts a kind's per-optimizer tensors through its entry: a third kind's buffer is
  counted while its entry names it, and not once the entry is gone.
* The scale plan (``benchmarks/scale.py``) reads a kind's cost and its planned checkpoint entries
  (``checkpoint.format.kinds.PlannedEntries``) from its entry: a third kind with rules of its own gets its own
  figures; Gefen's planned entries are the ones its state adapter writes.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from benchmarks import scale
from gefen_titan.checkpoint.format import kinds, schema
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import registry, state_size
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.state_cost import StateCost


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(64, 64, bias=False)
        self.norm = nn.LayerNorm(64)
        self.out = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.out(self.norm(self.attn(x)))


def _stepped(groups, **config):
    torch.manual_seed(0)
    model = Net()
    opt = GefenOptimizersContainer.Config(param_groups=groups, **config).build(model_parts=[model])
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("groups", [
    # NorMuon on, as GefenMuonHybrid has it (its rows are part of GefenMuon's rule)
    [ParamGroup(pattern=r"attn|out", optimizer_name="GefenMuon", optimizer_kwargs={"lr": 0.02, "normuon": True}),
     ParamGroup(pattern=r".*", optimizer_name="Gefen", optimizer_kwargs={"lr": 1e-3})],
    [ParamGroup(pattern=r"attn", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3}),
     ParamGroup(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
], ids=["gefen_muon+gefen", "adam+adamw"])
def test_every_kinds_rule_is_what_its_real_optimizer_holds(groups):
    opt = _stepped(groups)
    want = 0
    for optim in opt.optimizers:
        cost = registry.spec_of(optim).cost
        want += cost.optimizer_bytes
        for group in optim.param_groups:
            for p in group["params"]:
                want += cost.param_bytes(tuple(p.shape), gx.period(optim, p) or 0, p.element_size())
    assert {registry.spec_of(o).name for o in opt.optimizers} == {g.optimizer_name for g in groups}
    assert want == opt.state_bytes()[0] > 0


def test_gefens_factored_and_block_rules_are_what_their_optimizers_hold():
    """``second_moment = "factored"``: its rule (``COST.under(options)``) is the real optimizer's, and smaller
    than the block rule on the same parameters (a magnitude per block and one fp32 per row and column,
    against a magnitude, a vmean and two scratch floats per block)."""
    from gefen_titan.optim.kinds.gefen.options import GefenOptions

    options = GefenOptions(second_moment="factored")
    opt = _stepped([ParamGroup(pattern=r".*", optimizer_name="Gefen", optimizer_kwargs={"lr": 1e-3})],
                   gefen=options)
    (optim,) = opt.optimizers
    cost = registry.spec_of(optim).cost
    factored, block = cost.under(options), cost.under(GefenOptions(second_moment="block"))
    assert factored is not block and factored.param_bytes is cost.param_bytes  # the entry's is the default's
    assert cost.under(GefenOptions()).param_bytes is cost.param_bytes  # "auto": factored under agreed blocking
    shapes = [(tuple(p.shape), gx.period(optim, p), p.element_size()) for g in optim.param_groups for p in g["params"]]
    assert cost.optimizer_bytes + sum(factored.param_bytes(*s) for s in shapes) == opt.state_bytes()[0]
    assert sum(factored.param_bytes(*s) for s in shapes) < sum(block.param_bytes(*s) for s in shapes)
    # An empty shard of a matrix keeps its columns (its rows are none).
    assert factored.param_bytes((0, 64), 64, 4) == 4 * 64 and block.param_bytes((0, 64), 64, 4) == 0
    # The block rule is the real block optimizer's (same parameters, same periods: the agreed blocking
    # scores the first gradient alike).
    blocked = _stepped([ParamGroup(pattern=r".*", optimizer_name="Gefen", optimizer_kwargs={"lr": 1e-3})],
                       gefen=GefenOptions(second_moment="block"))
    (optim_b,) = blocked.optimizers
    shapes_b = [(tuple(p.shape), gx.period(optim_b, p), p.element_size())
                for g in optim_b.param_groups for p in g["params"]]
    assert cost.optimizer_bytes + sum(block.param_bytes(*s) for s in shapes_b) == blocked.state_bytes()[0]


class _Buffered(torch.optim.SGD):
    """A third kind: SGD with momentum, and a buffer of its own outside ``optim.state``."""

    def __init__(self, params, **kw):
        super().__init__(params, momentum=0.9, **kw)
        self.buffer = torch.zeros(7)


@pytest.fixture
def buffered_registered():
    registry.register(registry.OptimizerSpec(
        name="Buffered", factory=_Buffered, owns=lambda o: type(o) is _Buffered, group_keys=("lr",),
        cost=StateCost(lambda sizes, period, element_size: math.prod(sizes) * element_size, optimizer_bytes=28,
                       optimizer_tensors=lambda o: [o.buffer])))
    yield
    registry.unregister("Buffered")


def test_state_size_counts_a_kinds_own_tensors_through_its_entry(buffered_registered):
    p = nn.Parameter(torch.randn(5, 3))
    optim = _Buffered([p], lr=0.1)
    p.grad = torch.ones_like(p)
    optim.step()
    momentum = 5 * 3 * 4
    assert state_size.state_bytes([optim]) == (momentum + 7 * 4, 15)  # the entry names its buffer
    registry.unregister("Buffered")
    assert state_size.state_bytes([optim]) == (momentum, 15)  # no entry: its per-parameter state alone


def _built(*shapes) -> scale.Built:
    """The plan's view of parameters FSDP-sharded over 2 ranks (no process group: the plan's own chunks)."""
    params = [scale.Param(f"layers.0.w{i}", shape, torch.float32, (Shard(0),), (2,), [(0,), (1,)],
                          shape[-1], [8, shape[-1]]) for i, shape in enumerate(shapes)]
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    return scale.Built("x", scale.mesh_for("fsdp", 2), sum(math.prod(s) for s in shapes), params, "/ckpt/step-1",
                       [], hyper, False)


@pytest.fixture
def tripled_registered():
    """A kind with a cost rule and planned entries of its own (3 B per element plus its period; one int16
    tensor per parameter, one record per optimizer)."""
    planned = kinds.PlannedEntries(
        param_tensors=lambda p: {f"gefen/tripled/{p.fqn}": (torch.int16, p.shape)},
        optimizer_entries=lambda opt, params, step, det: {
            f"gefen/tripled_record/{opt}": json.dumps([[p.fqn, p.period, step] for p in params])})
    registry.register(registry.OptimizerSpec(
        name="Tripled", factory=torch.optim.SGD, owns=lambda o: False, group_keys=("lr",),
        cost=StateCost(lambda sizes, period, element_size: 3 * math.prod(sizes) + period, optimizer_bytes=5),
        checkpoint=kinds.KindDescription(name="Tripled", key_rows=(
                                             schema.KeyRow("tripled", "gefen/tripled/{fqn}"),
                                             schema.KeyRow("tripled_record", "gefen/tripled_record/{opt}", "str")),
                                         read=lambda inp, problems: kinds.KindRecords("Tripled", []),
                                         versions=frozenset({schema.VERSION}), planned_entries=planned)))
    yield
    registry.unregister("Tripled")


def test_the_plan_reads_a_kinds_rules_from_its_entry(tripled_registered):
    built = _built((8, 16), (6, 32))
    # Per rank: its codebook-like 5 B, then 3 B per element of its shards plus the period (the row unit).
    assert scale.state_bytes(built, "Tripled") == [5 + 3 * 4 * 16 + 16 + 3 * 3 * 32 + 32] * 2
    assert scale.state_bytes(built, "Tripled", periods={"layers.0.w0": 8})[0] == 5 + 3 * 64 + 8 + 3 * 96 + 32
    gefen = registry.get("Gefen").cost.param_bytes
    assert scale.state_bytes(built, "Gefen") == [1024 + gefen((4, 16), 16, 4) + gefen((3, 32), 32, 4)] * 2
    entries = scale.optimizer_entries(built, "Tripled", step=3)
    assert [(e.key, e.kind, e.dtype, e.shape) for e in entries] == [
        ("optimizer." + schema.header_key(), "bytes", None, ()),
        ("optimizer.gefen/tripled/layers.0.w0", "dtensor", torch.int16, (8, 16)),
        ("optimizer.gefen/tripled/layers.0.w1", "dtensor", torch.int16, (6, 32)),
        ("optimizer.gefen/tripled_record/layers.0.w0", "bytes", None, ())]
    assert json.loads(entries[-1].value) == [["layers.0.w0", 16, 3], ["layers.0.w1", 32, 3]]
    acc = scale.account(entries, 2, scale.Chunks())
    assert acc.chunks == 2 * 2 + 2 and sum(acc.items_per_rank) == acc.chunks  # each tensor's two halves


@pytest.mark.parametrize("second_moment", ["auto", "block", "factored"])
def test_gefens_planned_entries_are_what_its_adapter_writes(second_moment):
    from gefen_titan.optim.kinds.gefen.options import GefenOptions

    options = GefenOptions(second_moment=second_moment)
    opt = _stepped([ParamGroup(pattern=r".*", optimizer_name="Gefen", optimizer_kwargs={"lr": 1e-3})],
                   gefen=options)
    (optim,) = opt.optimizers_of("Gefen")
    written = opt.state_dict()
    planned = registry.get("Gefen").checkpoint.planned_entries
    plan_options = {} if second_moment == "auto" else {"second_moment": second_moment}  # {}: the default's
    params = [kinds.PlannedParam(fqn, tuple(p.shape), gx.period(optim, p), 1, group, plan_options)
              for fqn, p, group in gx.named_params(optim)]
    assert any("gefen/vrow/" in k for k in written) == (second_moment != "block")
    want = {}
    for p in params:
        want.update(planned.param_tensors(p))
    opt_id = params[0].fqn
    extra = planned.optimizer_entries(opt_id, params, gx.global_step(optim), gx.options(optim)["deterministic"])
    mine = {k: v for k, v in written.items() if schema.parse_key(k) and k != schema.header_key()}
    assert list(mine) == list(want) + list(extra)  # the adapter's order
    for key, (dtype, shape) in want.items():
        assert (mine[key].dtype, tuple(mine[key].shape)) == (dtype, shape), key
    (record, codebook) = extra
    assert mine[record] == extra[record]  # the record's JSON, byte for byte
    assert (mine[codebook].dtype, tuple(mine[codebook].shape)) == extra[codebook]
