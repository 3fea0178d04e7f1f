"""GefenOptimizersContainer: registration under the name "Gefen", names on
params, mixed Gefen/AdamW groups, LR schedulers, one Gefen per model part."""

import pytest
import torch
import torch.nn as nn
from gefen import Gefen
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig

from gefen_titan.optim.container import GefenOptimizersContainer


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
        period_one_substrings=["out"],
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
    assert len(opt.gefen_optimizers) == 2


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
