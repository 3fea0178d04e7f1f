"""Each optimizer kind's state cost lives on its registry entry, and whoever counts state asks the entry.

* Every registered rule (``OptimizerSpec.cost``: Gefen, GefenMuon, AdamW, Adam) is what the real optimizer
  holds after a step on a tiny model, per parameter and per optimizer (``optim.state_size``'s count).
* ``optim.state_size`` counts a kind's per-optimizer tensors through its entry: a third kind's buffer is
  counted while its entry names it, and not once the entry is gone.
* Gefen's planned checkpoint entries (``checkpoint.kinds.PlannedEntries``) are the ones its state adapter
  writes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from gefen_titan.checkpoint import kinds, schema
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


def _stepped(groups):
    torch.manual_seed(0)
    model = Net()
    opt = GefenOptimizersContainer.Config(param_groups=groups).build(model_parts=[model])
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


def test_gefens_planned_entries_are_what_its_adapter_writes():
    opt = _stepped([ParamGroup(pattern=r".*", optimizer_name="Gefen", optimizer_kwargs={"lr": 1e-3})])
    (optim,) = opt.optimizers_of("Gefen")
    written = opt.state_dict()
    planned = registry.get("Gefen").checkpoint.planned_entries
    params = [kinds.PlannedParam(fqn, tuple(p.shape), gx.period(optim, p), 1, group)
              for fqn, p, group in gx.named_params(optim)]
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
