"""GefenOptimizersContainer and its registry: registration under the name
"Gefen", names on params, mixed Gefen/AdamW groups, LR schedulers, one Gefen
per model part; a new registry entry is usable by name and checkpointed by its
own state adapter; a Gefen subclass without an entry is refused."""

import pytest
import torch
import torch.nn as nn
from gefen import Gefen
from torch.distributed.checkpoint.metadata import Metadata
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import param_groups, registry
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.kinds.gefen.options import GefenOptions


class Block(nn.Module):  # no forward: these tests never step
    def __init__(self, dim=64):
        super().__init__()
        self.attn = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 32)


def _config(**kw):
    return GefenOptimizersContainer.Config(**kw)


def test_gefen_built_with_param_names_and_hyperparameters():
    model = Block()
    opt = _config(name="Gefen", lr=2e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05).build(
        model_parts=[model]
    )
    assert len(opt.optimizers) == 1
    gefen = opt.optimizers[0]
    assert isinstance(gefen, Gefen)
    (group,) = gefen.param_groups
    assert group["param_names"] == [n for n, _ in model.named_parameters()]
    assert group["lr"] == 2e-3 and group["eps"] == 1e-7 and group["weight_decay"] == 0.05
    assert (group["beta1"], group["beta2"]) == (0.8, 0.9)
    # Optimizer-wide options are constructor arguments, not stray group keys.
    assert "fused" not in group and "foreach" not in group
    assert gefen._factored_v_2d is False
    assert gefen._force_1d_period_one is True
    assert gefen.fused is False  # no CUDA here


def test_unknown_optimizer_name_is_refused():
    with pytest.raises(ValueError, match="optimizer.name"):
        _config(name="Lion")
    with pytest.raises(NotImplementedError):
        GefenOptimizersContainer._resolve_optimizer_factory("Lion")


def test_mixed_gefen_and_adamw_groups():
    model = Block()
    config = _config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=r"norm|bias", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.0}),
            ParamGroupConfig(pattern=r".*", optimizer_name="Gefen",
                             optimizer_kwargs={"lr": 3e-3, "betas": (0.9, 0.95)}),
        ],
        gefen=GefenOptions(period_one_substrings=["out"]),
    )
    opt = config.build(model_parts=[model])
    kinds = {type(o).__name__: o for o in opt.optimizers}
    assert set(kinds) == {"AdamW", "Gefen"}
    adam_names = kinds["AdamW"].param_groups[0]["param_names"]
    gefen_names = kinds["Gefen"].param_groups[0]["param_names"]
    assert set(adam_names) == {"norm.weight", "norm.bias", "out.bias"}
    assert set(gefen_names) == {"attn.weight", "out.weight"}
    assert kinds["Gefen"]._period_one_substrings == ("out",)


def test_one_gefen_per_pipeline_model_part():
    parts = [Block(), Block()]
    opt = _config(name="Gefen").build(model_parts=parts)
    assert len(opt.optimizers) == 2 and all(isinstance(o, Gefen) for o in opt.optimizers)
    assert len(opt.optimizers_of("Gefen")) == 2


def test_lr_scheduler_drives_gefen_groups():
    opt = _config(name="Gefen", lr=1e-2).build(model_parts=[Block()])
    scheds = LRSchedulersContainer.Config(warmup_steps=4, decay_ratio=None, min_lr_factor=0.0).build(
        optimizers=opt, training_steps=10
    )
    lrs = []
    for _ in range(3):
        lrs.append(opt.optimizers[0].param_groups[0]["lr"])
        scheds.step()
    assert lrs[0] < lrs[1] < lrs[2] <= 1e-2  # warmup ramps Gefen's lr


def test_gefen_step_moves_weights_with_compact_state(gefen_stepped):
    """One real Gefen step through the container moves the weights, with state
    of ~1 byte per param for the matrices (block period > 1)."""
    model, opt, before = gefen_stepped
    for name, p in model.named_parameters():
        assert not torch.equal(before[name], p.detach()), name
    gefen = opt.optimizers[0]
    st = gefen.state[model.attn.weight]
    assert st["m_codebook"].dtype == torch.uint8
    assert st["m_codebook"].numel() == model.attn.weight.numel()
    assert int(st["automatic_period"]) > 1


def test_gefen_reads_the_group_keys_we_accept():
    """Contract with gefen-x: every group key the Gefen entry accepts reaches the group."""
    spec = registry.get("Gefen")
    assert spec.group_keys == ("lr", "betas", "eps", "weight_decay", "fused")
    p = torch.nn.Parameter(torch.zeros(8, 8))
    opt = spec.factory([{"params": [p], "param_names": ["w"], "lr": 0.5, "betas": (0.7, 0.8), "eps": 0.25,
                         "weight_decay": 0.125, "fused": False}])
    (group,) = opt.param_groups
    hyper = (group["lr"], group["beta1"], group["beta2"], group["eps"], group["weight_decay"])
    assert hyper == (0.5, 0.7, 0.8, 0.25, 0.125)
    assert "fused" not in group  # a constructor argument, not a stray group key


class _GefenVariant(Gefen):
    """Stands for gefen-x's GefenMuon: a Gefen subclass with state of its own."""


def test_a_gefen_subclass_is_not_taken_for_gefen():
    variant = _GefenVariant([torch.nn.Parameter(torch.zeros(4, 4))])
    plain = Gefen([torch.nn.Parameter(torch.zeros(4, 4))])
    assert gx.is_gefen(plain) and not gx.is_gefen(variant) and gx.is_gefenx_optimizer(variant)
    assert registry.spec_of(plain).name == "Gefen" and registry.spec_of(variant) is None


def test_an_unregistered_gefen_subclass_is_refused(monkeypatch):
    """An optimizer factory torchtitan resolves (here a patched one) that builds a
    Gefen subclass: the container refuses it at construction, naming the fix."""
    from torchtitan.components.optimizer import OptimizersContainer

    def resolve(name):
        assert name == "GefenVariant"
        return lambda groups, **kw: _GefenVariant([pair for g in groups for pair in zip(g["param_names"], g["params"])])

    monkeypatch.setattr(OptimizersContainer, "_resolve_optimizer_factory", staticmethod(resolve))
    config = _config(param_groups=[ParamGroup(pattern=".*", optimizer_name="GefenVariant")])
    with pytest.raises(ValueError, match="_GefenVariant is a subclass of Gefen that gefen-titan has no registry entry"):
        config.build(model_parts=[Block()])


class _RecordingState:
    """A StateAdapter that records what the container asks of it."""

    def __init__(self, optimizers, options):
        self.optimizers, self.options, self.calls = optimizers, options, []
        self.snapshot_on_save = False

    def state_dict(self):
        self.calls.append("state_dict")
        return {"variant/entry": torch.tensor([len(self.optimizers)])}

    def stage_load(self, state_dict, verdict):
        self.calls.append(("stage", int(state_dict["variant/entry"])))

    def commit_load(self):
        self.calls.append("commit")

    def prepare_load(self, ctx, verdict):
        self.calls.append(("prepare", ctx.checkpoint_id, sorted(ctx.entries)))

    def abort_load(self):
        self.calls.append("abort")


def test_a_registered_variant_is_one_entry(monkeypatch):
    """A new optimizer kind: one OptimizerSpec. The container builds it by name,
    fills in its option keys, checks its group keys, and checkpoints it through
    its own state adapter (every other optimizer keeps torchtitan's flat state)."""
    built = {}

    def factory(groups, **kw):
        built["groups"] = groups
        return _GefenVariant([(n, p) for g in groups for n, p in zip(g["param_names"], g["params"])])

    spec = registry.OptimizerSpec(name="GefenVariant", factory=factory,
                                  owns=lambda o: type(o) is _GefenVariant,
                                  group_keys=("lr", "betas", "eps", "weight_decay"),
                                  option_keys=("deterministic",), options="gefen", state=_RecordingState)
    monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
    config = _config(param_groups=[ParamGroup(pattern="attn", optimizer_name="GefenVariant",
                                              optimizer_kwargs={"lr": 0.5}),
                                   ParamGroup(pattern=".*", optimizer_name="AdamW")],
                     gefen=GefenOptions(deterministic=True))
    param_groups.check_param_groups(config)
    opt = config.build(model_parts=[Block()])
    assert [type(o).__name__ for o in opt.optimizers] == ["_GefenVariant", "AdamW"]
    # the option_keys of the table it names ([optimizer.gefen]), for the variant's groups
    assert built["groups"][0]["deterministic"] is True and "cpu_step" not in built["groups"][0]
    (variant_state,) = [s for s in opt._states if isinstance(s, _RecordingState)]
    assert variant_state.optimizers == [opt.optimizers[0]] and variant_state.options.blocking == "agreed"
    sd = opt.state_dict()
    assert sd["variant/entry"].item() == 1 and any(k.startswith("state.") for k in sd)  # AdamW: flat
    opt.prepare_load("ckpt", Metadata(state_dict_metadata={}), "optimizer.")  # a checkpoint without Gefen state
    opt.load_state_dict(sd)
    assert variant_state.calls[-3:] == [("prepare", "ckpt", []), ("stage", 1), "commit"]
    bad = _config(param_groups=[ParamGroup(pattern=".*", optimizer_name="GefenVariant",
                                           optimizer_kwargs={"momentum": 0.9})])
    with pytest.raises(ValueError, match="GefenVariant does not read 'momentum'"):
        param_groups.check_param_groups(bad)


def test_a_container_without_gefen_state_loads_without_the_manager():
    """AdamW alone in the container: its flat state round-trips through
    ``state_dict``/``load_state_dict`` with no ``prepare_load`` (torchtitan's
    own checkpointer, a benchmark), as torchtitan's container does; the Gefen
    and GefenMuon adapters have nothing to load and must not refuse."""
    model = Block()
    opt = _config(name="AdamW").build(model_parts=[model])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state_dict().items()}
    other = _config(name="AdamW").build(model_parts=[Block()])
    other.load_state_dict(sd)
    (adam,) = other.optimizers
    assert all(torch.equal(adam.state[p]["exp_avg"], torch.full_like(p, 0.1)) for p in adam.state)
    assert len(adam.state) == len(list(model.parameters()))
