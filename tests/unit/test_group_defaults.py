"""What a param group that leaves a hyperparameter out gets: as in torchtitan
("no implicit defaults"), its optimizer's own default (torch's for AdamW and
Adam, gefen-x's for Gefen and GefenMuon), unless the [optimizer] shorthand
key was set, which then stands for every group that leaves it out. Only the
catch-all group (no param_groups) takes the shorthand's own defaults."""

import inspect

import gefen
import pytest
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig, default_adamw

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import param_groups
from gefen_titan.optim.container import SHORTHAND_DEFAULTS, GefenOptimizersContainer

HYPER = ("lr", "betas", "eps", "weight_decay")


class Block(nn.Module):  # no forward: these tests never step
    def __init__(self, dim=64):
        super().__init__()
        self.attn = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 32)


def _groups(opt):
    """Each built param group by its first parameter's name."""
    return {g["param_names"][0]: g for o in opt.optimizers for g in o.param_groups}


def _torch_groups():
    # Adam and AdamW each leave keys out; "out" is split so both kinds are seen.
    return [
        ParamGroupConfig(pattern=r"^norm\.", optimizer_name="Adam", optimizer_kwargs={"lr": 3e-3}),
        ParamGroupConfig(pattern=r"^out\.bias", optimizer_name="AdamW", optimizer_kwargs={"eps": 1e-6}),
    ]


def _gefen_signature(cls):
    return {k: p.default for k, p in inspect.signature(cls).parameters.items() if k != "params"}


def test_explicit_groups_get_their_optimizers_own_defaults():
    groups = [*_torch_groups(),
              ParamGroupConfig(pattern=r"^attn\.", optimizer_name="GefenMuon", optimizer_kwargs={"momentum": 0.9}),
              ParamGroupConfig(pattern=r".*", optimizer_name="Gefen", optimizer_kwargs={"betas": (0.8, 0.9)})]
    ours = _groups(GefenOptimizersContainer.Config(implementation="for-loop", param_groups=groups)
                   .build(model_parts=[Block()]))
    # The same torch groups in torchtitan's own container (which has no Gefen).
    stock = _groups(OptimizersContainer.Config(implementation="for-loop", param_groups=[
        *_torch_groups(), ParamGroupConfig(pattern=r".*", optimizer_name="AdamW")]).build(model_parts=[Block()]))
    for name in ("norm.weight", "out.bias"):
        assert {k: ours[name][k] for k in HYPER} == {k: stock[name][k] for k in HYPER}, name
    assert ours["norm.weight"]["weight_decay"] == 0  # Adam's coupled L2: off unless asked for
    assert ours["out.bias"]["betas"] == (0.9, 0.999) and ours["out.bias"]["weight_decay"] == 0.01

    want = _gefen_signature(gefen.Gefen)
    g = ours["out.weight"]
    assert (g["beta1"], g["beta2"]) == (0.8, 0.9)
    assert (g["lr"], g["eps"], g["weight_decay"]) == (want["lr"], want["eps"], want["weight_decay"])

    muon, defaults = ours["attn.weight"], gx.muon_defaults()
    assert muon["momentum"] == 0.9
    assert (muon["lr"], muon["weight_decay"], muon["eps"]) == (defaults["lr"], defaults["weight_decay"],
                                                              defaults["eps"])


def test_a_set_shorthand_key_stands_for_the_groups_that_leave_it_out():
    config = GefenOptimizersContainer.Config(
        implementation="for-loop", lr=2e-3, eps=1e-7, weight_decay=0.05,
        param_groups=[*_torch_groups(),
                      ParamGroupConfig(pattern=r"^attn\.", optimizer_name="GefenMuon"),
                      ParamGroupConfig(pattern=r".*", optimizer_name="Gefen")])
    ours = _groups(config.build(model_parts=[Block()]))
    adam, adamw, muon, gefen_group = (ours[n] for n in ("norm.weight", "out.bias", "attn.weight", "out.weight"))
    assert (adam["lr"], adam["eps"], adam["weight_decay"]) == (3e-3, 1e-7, 0.05)  # its own lr wins
    assert (adamw["lr"], adamw["eps"], adamw["weight_decay"]) == (2e-3, 1e-6, 0.05)
    assert adam["betas"] == adamw["betas"] == (0.9, 0.999)  # betas unset: torch's
    assert (gefen_group["lr"], gefen_group["eps"], gefen_group["weight_decay"]) == (2e-3, 1e-7, 0.05)
    assert (gefen_group["beta1"], gefen_group["beta2"]) == _gefen_signature(gefen.Gefen)["betas"]
    # GefenMuon takes lr and weight_decay only; its eps is the Newton-Schulz floor.
    assert (muon["lr"], muon["weight_decay"], muon["eps"]) == (2e-3, 0.05, gx.muon_defaults()["eps"])


def test_only_set_shorthand_keys_can_go_unused():
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]
    assert param_groups.unused_defaults(GefenOptimizersContainer.Config(param_groups=groups)) == ["name"]
    config = GefenOptimizersContainer.Config(param_groups=groups, lr=2e-3, eps=1e-7)
    assert param_groups.unused_defaults(config) == ["name", "lr"]


@pytest.mark.parametrize("name", ["Gefen", "AdamW", "Adam"])
def test_the_catch_all_group_takes_the_shorthand_defaults(name):
    (group,) = param_groups.resolved_param_groups(GefenOptimizersContainer.Config(name=name))
    assert group.pattern == ".*" and group.optimizer_name == name
    assert group.optimizer_kwargs == SHORTHAND_DEFAULTS == {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                                                            "weight_decay": 0.1}
    (group,) = param_groups.resolved_param_groups(GefenOptimizersContainer.Config(name=name, lr=1e-2, betas=(0.8, 0.9)))
    assert group.optimizer_kwargs == {**SHORTHAND_DEFAULTS, "lr": 1e-2, "betas": (0.8, 0.9)}


def test_from_torchtitan_keeps_explicit_groups_and_lifts_default_adamw():
    stock = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        *_torch_groups(), ParamGroupConfig(pattern=r".*", optimizer_name="AdamW")])
    ours = GefenOptimizersContainer.Config.from_torchtitan(stock)
    assert ours.param_groups == stock.param_groups and ours.lr is None
    built, want = (_groups(c.build(model_parts=[Block()])) for c in (ours, stock))
    assert {n: {k: g[k] for k in HYPER} for n, g in built.items()} == \
        {n: {k: g[k] for k in HYPER} for n, g in want.items()}
    # default_adamw's catch-all group becomes the shorthand, set, so [optimizer] name can replace it.
    lifted = GefenOptimizersContainer.Config.from_torchtitan(default_adamw(lr=3e-4))
    assert not lifted.param_groups
    assert (lifted.name, lifted.lr, lifted.betas, lifted.eps, lifted.weight_decay) == ("AdamW", 3e-4, (0.9, 0.95),
                                                                                       1e-8, 0.1)
    # A catch-all group that leaves keys out stays a group: AdamW's own defaults, not the shorthand's.
    partial = OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                                                        optimizer_kwargs={"lr": 1e-3})])
    kept = GefenOptimizersContainer.Config.from_torchtitan(partial)
    assert kept.param_groups == partial.param_groups and kept.weight_decay is None
    assert GefenOptimizersContainer.Config.from_torchtitan(kept) is kept
