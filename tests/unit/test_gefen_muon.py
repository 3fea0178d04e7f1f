"""GefenMuon's registry entry, its records, and its single-process step
against gefen-x's own GefenMuon (its schedule: test_muon_schedule.py; the
multi-rank layouts: tests/integration/test_gefen_muon.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from gefen import GefenMuon

from gefen_titan.checkpoint.format.schema import FormatError
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import param_groups, registry, state_size
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.kinds.gefen_muon import entry as gefen_muon_entry
from gefen_titan.optim.kinds.gefen_muon.options import MuonOptions
from gefen_titan.optim.kinds.gefen_muon.records import (
    MUON_HYPER,
    MuonOptimizerRecord,
    MuonParamRecord,
    check_muon_counters,
    check_muon_hyper,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.w1 = nn.Linear(64, 128, bias=False)
        self.w2 = nn.Linear(128, 64, bias=False)
        self.norm = nn.LayerNorm(64)


MUON = r"^w[12]\.weight$"


def _config(muon_kwargs=None, **kw):
    groups = [ParamGroup(pattern=MUON, optimizer_name="GefenMuon", optimizer_kwargs=muon_kwargs or {}),
              ParamGroup(pattern=".*")]
    return GefenOptimizersContainer.Config(name="Gefen", lr=3e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05,
                                           param_groups=groups, **kw)


# ------------------------------------------------------------------ registry
def test_groups_get_gefen_x_defaults_and_only_lr_and_weight_decay_from_the_shorthand():
    opt = _config().build(model_parts=[Net()])
    muon, gefen = opt.optimizers
    assert gx.is_gefen_muon(muon) and gx.is_gefen(gefen)
    assert not gx.is_gefen(muon)  # a Gefen subclass, never taken for Gefen
    (group,) = muon.param_groups
    assert group["param_names"] == ["w1.weight", "w2.weight"]
    defaults = gx.muon_defaults()
    for key in MUON_HYPER:
        want = {"lr": 3e-3, "weight_decay": 0.05}.get(key, defaults[key])
        assert group[key] == want, key
    assert group["eps"] == defaults["eps"]  # the shorthand's eps is Adam's, not the Newton-Schulz floor
    assert "betas" not in group
    assert registry.get("GefenMuon").shorthand_keys == ("lr", "weight_decay")


@pytest.mark.parametrize("key, value", [("fp8_ns", True), ("batched_ns", True), ("stochastic_round", True),
                                        ("cautious", True), ("sharded_mode", "distributed")])
def test_layout_dependent_options_are_refused_with_the_reason(key, value):
    config = _config({key: value})
    with pytest.raises(ValueError, match=f"{key}.*refused: {gx.MUON_REFUSED[key][:20]}"):
        param_groups.check_param_groups(config)


def test_refused_constructor_options_and_per_rank_blocking():
    with pytest.raises(ValueError, match="GefenMuon.capturable: .* is refused: capturable keeps"):
        _config(optimizer_factory_kwargs_by_name={"GefenMuon": {"capturable": True}}).build(model_parts=[Net()])
    with pytest.raises(ValueError, match='needs optimizer.blocking.mode = "agreed"'):
        param_groups.check_param_groups(_config(blocking=BlockingOptions(mode="per_rank")))
    with pytest.raises(ValueError, match="momentum"):
        param_groups.check_param_groups(_config({"betas": [0.9, 0.95]}))


def test_a_parameter_that_is_not_a_matrix_is_refused():
    config = GefenOptimizersContainer.Config(param_groups=[
        ParamGroup(pattern=r"^norm\.", optimizer_name="GefenMuon"), ParamGroup(pattern=".*")])
    with pytest.raises(ValueError, match=r"matrices only.*norm.weight \(64,\).*narrow the GefenMuon pattern"):
        config.build(model_parts=[Net()])


def test_gefen_x_step_cannot_be_reached():
    opt = _config().build(model_parts=[Net()])
    muon = opt.optimizers[0]
    with pytest.raises(ValueError, match="no closure"):
        muon.step(lambda: 0.0)
    bare = gx.new_gefen_muon([{"params": [("w", nn.Parameter(torch.zeros(8, 8)))]}])
    with pytest.raises(RuntimeError, match="no sharded step"):
        bare.step()
    calls = []  # the step it is built with is the step it runs
    composed = gx.new_gefen_muon([{"params": [("w", nn.Parameter(torch.zeros(8, 8)))]}],
                                 lambda o: lambda: calls.append(o))
    composed.step()
    assert calls == [composed]


# ------------------------------------------------------------------ owners
def test_the_bucket_size_reaches_the_sharded_step_and_a_bad_one_is_refused():
    opt = _config(muon=MuonOptions(bucket_mib=3)).build(model_parts=[Net()])
    (muon,) = opt.optimizers_of("GefenMuon")
    assert gx.muon_sharded_step(muon).bucket_bytes == 3 * 2**20
    (default,) = _config().build(model_parts=[Net()]).optimizers_of("GefenMuon")
    assert gx.muon_sharded_step(default).bucket_bytes == 512 * 2**20
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="optimizer.muon.bucket_mib must be > 0"):
            MuonOptions(bucket_mib=bad)
        with pytest.raises(ValueError, match="optimizer.muon.bucket_mib must be > 0"):  # the factory's own check
            gefen_muon_entry.build_gefen_muon([{"params": [nn.Parameter(torch.zeros(4, 4))], "param_names": ["w"],
                                                "bucket_mib": bad}])


# ------------------------------------------------------------------ records
def _record(**group_over):
    group = {**gx.muon_defaults(), "lr": 0.02, "weight_decay": 0.1, **group_over}
    return MuonOptimizerRecord(False, 7, [MuonParamRecord("w1.weight", (128, 64), 32, 7, 7, group),
                                          MuonParamRecord("w2.weight", (64, 128), 0, 0, 0, group)])


def test_records_round_trip_and_name_their_kind():
    rec = _record()
    raw = rec.to_json()
    assert json.loads(raw)["kind"] == "GefenMuon"
    back = MuonOptimizerRecord.from_json(raw, "w1.weight")
    assert back.to_json() == raw
    assert back.params[0].grid == (128, 2) and back.params[1].grid is None
    for p in back.params:
        check_muon_hyper(p.fqn, p.group)
    gefen_record = json.dumps({**json.loads(raw), "kind": "Gefen"})
    with pytest.raises(FormatError, match="not an agreed-blocking GefenMuon record"):
        MuonOptimizerRecord.from_json(gefen_record, "w1.weight")


@pytest.mark.parametrize("key, value", [("ns_steps", 0), ("momentum", 1.0), ("nesterov", 1), ("lr", float("nan")),
                                        ("adjust_lr_fn", "spectral"), ("ns_coefficients", [1.0, 2.0])])
def test_invalid_group_keys_in_a_record_are_refused(key, value):
    group = json.loads(_record().to_json())["params"][0]["group"]
    group[key] = value
    with pytest.raises(FormatError, match=key if key != "momentum" else "momentum"):
        check_muon_hyper("w1.weight", group)


def test_counters_must_add_up():
    assert check_muon_counters("w", 32, 3, 3, 3) is None
    assert "do not add up" in check_muon_counters("w", 32, 3, 4, 4)
    assert "do not add up" in check_muon_counters("w", 0, 3, 0, 3)
    assert "global step" in check_muon_counters("w", 32, 5, 5, 4)


# ------------------------------------------------------------------ step
def test_single_process_step_is_gefen_x_given_the_same_periods_and_codebook():
    torch.manual_seed(0)
    net = Net()
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = _config({"lr": 0.02, "normuon": True}).build(model_parts=[net])
    muon = opt.optimizers[0]
    ref_params = {n: nn.Parameter(init[n].clone()) for n in ("w1.weight", "w2.weight")}
    ref = GefenMuon(list(ref_params.items()), fused=False, **{k: muon.param_groups[0][k] for k in MUON_HYPER})
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = {n: torch.randn(p.shape, generator=gen) ** 3 for n, p in net.named_parameters()}
        for n, p in net.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        if step == 0:  # the container's agreement ran before its first step
            for n, q in ref_params.items():
                gx.set_period(ref, q, gx.period(muon, dict(net.named_parameters())[n]))
            gx.set_codebook(ref, gx.codebook(muon).clone())
        for n, q in ref_params.items():
            q.grad = grads[n].clone()
        ref.step()
        for n, q in ref_params.items():
            assert torch.equal(q, dict(net.named_parameters())[n]), (step, n)
    for n, q in ref_params.items():
        mine, theirs = gx.muon_read(muon, dict(net.named_parameters())[n]), gx.muon_read(ref, q)
        assert mine.period > 1 and mine.step == theirs.step == 4
        assert torch.equal(mine.codes, theirs.codes) and torch.equal(mine.magnitude, theirs.magnitude)
        assert torch.equal(mine.rows, theirs.rows)
    # 1 byte of code per element, an fp32 magnitude per block and per NorMuon
    # row, and the optimizer's one 256-entry fp32 codebook
    params = dict(net.named_parameters())
    want = gx.K * 4 + sum(q.numel() + 4 * q.numel() // gx.period(muon, params[n]) + 4 * q.shape[0]
                          for n, q in ref_params.items())
    assert state_size.state_bytes([muon])[0] == want


class MoENet(nn.Module):
    """An embedding, a grouped experts' weight (E, out, in) as torchtitan's GroupedExperts keeps it, a matrix."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.experts = nn.Parameter(torch.randn(4, 48, 64) / 8)
        self.w1 = nn.Linear(64, 96, bias=False)


@pytest.mark.parametrize("normuon, adjust", [(True, "match_rms_adamw"), (False, "original"), (True, None)])
def test_grouped_experts_step_as_one_gefen_x_matrix_per_expert(normuon, adjust):
    """A (E, out, in) weight under GefenMuon is E Muon matrices: parameters and state after every
    step equal gefen-x's GefenMuon over E separate (out, in) parameters, given the same period and
    codebook (the lr adjusted from an expert's shape, NorMuon per expert, weight decay per element)."""
    torch.manual_seed(0)
    net = MoENet()
    groups = [ParamGroup(pattern=r"^(experts|w1\.weight)$", optimizer_name="GefenMuon",
                         optimizer_kwargs={"lr": 0.02, "normuon": normuon, "adjust_lr_fn": adjust}),
              ParamGroup(pattern=".*")]
    opt = GefenOptimizersContainer.Config(name="Gefen", lr=3e-3, weight_decay=0.05, param_groups=groups
                                          ).build(model_parts=[net])
    muon = opt.optimizers[0]
    assert [n for n, _, _ in gx.named_params(muon)] == ["experts", "w1.weight"]
    experts = [nn.Parameter(net.experts.detach()[e].clone()) for e in range(4)]
    w1 = nn.Parameter(net.w1.weight.detach().clone())
    ref = GefenMuon([(f"e{e}", q) for e, q in enumerate(experts)] + [("w1", w1)], fused=False,
                    **{k: muon.param_groups[0][k] for k in MUON_HYPER})
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) ** 3 for n, p in net.named_parameters()}
        for n, p in net.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        if step == 0:  # the agreement set one period for the whole grouped weight
            period = gx.period(muon, net.experts)
            assert period > 1 and 64 % period == 0
            for q in experts:
                gx.set_period(ref, q, period)
            gx.set_period(ref, w1, gx.period(muon, net.w1.weight))
            gx.set_codebook(ref, gx.codebook(muon).clone())
        for e, q in enumerate(experts):
            q.grad = grads["experts"][e].clone()
        w1.grad = grads["w1.weight"].clone()
        ref.step()
        assert torch.equal(torch.stack([q.detach() for q in experts]), net.experts.detach()), step
        assert torch.equal(w1, net.w1.weight), step
    mine = gx.muon_read(muon, net.experts)
    theirs = [gx.muon_read(ref, q) for q in experts]
    assert mine.step == 3 and all(t.step == 3 for t in theirs)
    assert torch.equal(mine.codes, torch.cat([t.codes for t in theirs]))
    assert torch.equal(mine.magnitude, torch.cat([t.magnitude for t in theirs]))
    if normuon:
        assert mine.rows_step == 3 and torch.equal(mine.rows, torch.cat([t.rows for t in theirs]))
    else:
        assert mine.rows is None


def test_a_grouped_weight_is_registered_as_itself():
    w = nn.Parameter(torch.zeros(2, 6, 8))
    optim = gx.new_gefen_muon([{"params": [("experts", w), ("m", nn.Parameter(torch.zeros(6, 8)))]}])
    assert optim.param_groups[0]["params"][0] is w and "name" in optim.state[w]
    with pytest.raises(ValueError, match="only supports 2D"):  # gefen-x's own check still guards other shapes
        gx.new_gefen_muon([{"params": [nn.Parameter(torch.zeros(2, 2, 2, 2))]}])
