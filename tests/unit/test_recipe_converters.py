"""Model converters in recipes (gefen_titan/recipe/converters.py, issue 47):
a recipe's [model] table keeps the base config's converters, replaces them
only with its own [[model.converters]] tables, and refuses to rebuild a
converted base model whose converters it cannot see. Frozen parameters
(LoRA's base weights) hold no Gefen state and do not block the agreement."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
from torchtitan.components.lora import LoRAConverter
from torchtitan.models.llama3 import config_registry

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.recipe import RecipeError, load_recipe
from gefen_titan.recipe.converters import call_base_config

BASE = "llama3_lora_base_for_tests"


def _lora_base():
    """A base config function as torchtitan writes them (llama3_debugmodel_float8):
    the plain function first, then the spec again with converters, through
    its module's ``model_registry``."""
    config = config_registry.llama3_debugmodel()
    config.model_spec = config_registry.model_registry(
        "debugmodel", converters=[LoRAConverter.Config(rank=4, alpha=8.0, target_modules=["wo", "w2"])])
    return config


def _unseen_lora_base():
    """A base whose spec is built where the recording cannot see it."""
    from torchtitan.models import llama3

    config = config_registry.llama3_debugmodel()
    config.model_spec = llama3.model_registry("debugmodel", converters=[LoRAConverter.Config(rank=4)])
    return config


def _unseen_plain_base():
    from torchtitan.models import llama3

    config = config_registry.llama3_debugmodel()
    config.model_spec = llama3.model_registry("debugmodel")
    return config


@pytest.fixture
def bases(monkeypatch):
    for fn in (_lora_base, _unseen_lora_base, _unseen_plain_base):
        monkeypatch.setattr(config_registry, fn.__name__, fn, raising=False)


def _recipe(tmp_path, base: str, model: str = '[model]\nflavor = "debugmodel"\nattn_backend = "flex"\n') -> str:
    path = tmp_path / "r.toml"
    path.write_text(f'[job]\nmodule = "llama3"\nbase_config = "{base}"\n\n{model}\n[optimizer]\nname = "Gefen"\n')
    return str(path)


def _trainable(config) -> tuple[list[str], int]:
    with torch.device("meta"):
        model = config.model_spec.model.build()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return names, sum(1 for _ in model.parameters())


def _lora_ranks(config) -> set[int]:
    from torchtitan.protocols.module import Module

    configs = config.model_spec.model.traverse(Module.Config, recurse=True)
    return {c.rank for _, c, _, _ in configs if ".LoRALinear.Config" in type(c).__qualname__}


def test_model_table_keeps_the_base_configs_converters(tmp_path, bases):
    """The reported bug: [model] rebuilt the spec without the base's LoRA, so every weight trained."""
    config = load_recipe(_recipe(tmp_path, "_lora_base"), world_size=1).config
    names, total = _trainable(config)
    assert names and all(".lora_a." in n or ".lora_b." in n for n in names), names
    assert {n.split(".")[-3] for n in names} == {"wo", "w2"}  # the base's target_modules
    assert _lora_ranks(config) == {4}
    base_names, base_total = _trainable(_lora_base())
    assert (names, total) == (base_names, base_total)


def test_recipe_converters_replace_the_bases(tmp_path, bases):
    own = '[model]\n[[model.converters]]\nkind = "lora"\nrank = 2\ntarget_modules = ["w1"]\n'
    config = load_recipe(_recipe(tmp_path, "_lora_base", own), world_size=1).config
    names, _ = _trainable(config)
    assert {n.split(".")[-3] for n in names} == {"w1"} and _lora_ranks(config) == {2}
    # converters = [] drops them: every parameter trains again.
    config = load_recipe(_recipe(tmp_path, "_lora_base", "[model]\nconverters = []\n"), world_size=1).config
    names, total = _trainable(config)
    assert len(names) == total and not any("lora" in n for n in names)
    # On a plain base, the recipe's converters apply with the flavor it names.
    named = own.replace("[model]\n", '[model]\nflavor = "debugmodel"\n')
    config = load_recipe(_recipe(tmp_path, "llama3_debugmodel", named), world_size=1).config
    assert {n.split(".")[-3] for n in _trainable(config)[0]} == {"w1"}


def test_base_without_model_table_keeps_its_spec(tmp_path, bases):
    config = load_recipe(_recipe(tmp_path, "_lora_base", ""), world_size=1).config
    assert _lora_ranks(config) == {4}


@pytest.mark.parametrize("model,message", [
    ('[model]\n[[model.converters]]\nkind = "qlora"\n', "converters[0] kind: expected one of lora, float8, mxfp8"),
    ('[model]\n[[model.converters]]\nkind = "lora"\nrnak = 4\n', "converters[0] rnak: unknown key"),
    ('[model]\n[[model.converters]]\nkind = "lora"\nrank = "4"\n', "converters[0] rank: expected an integer"),
    ('[model]\nconverters = "lora"\n', "[model] converters: expected [[model.converters]] tables"),
    ('[model]\n[[model.converters]]\nkind = "lora"\nrank = 0\n', "LoRA rank must be positive"),
])
def test_bad_converter_tables_name_file_and_key(tmp_path, model, message):
    path = _recipe(tmp_path, "llama3_debugmodel", model)
    with pytest.raises(RecipeError, match="r.toml") as e:
        load_recipe(path, world_size=1)
    assert message in str(e.value)


def test_float8_and_mxfp8_without_torchao_say_what_they_need(tmp_path):
    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed here: these converters build (they run on GPUs: scripts/gpu_check.sh)")
    for kind in ("float8", "mxfp8"):
        path = _recipe(tmp_path, "llama3_debugmodel", f'[model]\n[[model.converters]]\nkind = "{kind}"\n')
        with pytest.raises(RecipeError, match=r"r.toml: \[model\] converters: .*torchao and a GPU"):
            load_recipe(path, world_size=1)


def test_converted_base_the_recording_cannot_see_is_refused(tmp_path, bases):
    with pytest.raises(RecipeError, match=r"base config's model is converted .*\[\[model.converters\]\]"):
        load_recipe(_recipe(tmp_path, "_unseen_lora_base"), world_size=1)
    # Saying what to train is enough: its own converters, or none.
    load_recipe(_recipe(tmp_path, "_unseen_lora_base", "[model]\nconverters = []\n"), world_size=1)
    # An unconverted base built the same way is rebuilt as before.
    load_recipe(_recipe(tmp_path, "_unseen_plain_base"), world_size=1)


def test_recording_restores_model_registry(bases):
    original = config_registry.model_registry

    def failing():
        config_registry.model_registry("debugmodel")
        raise RuntimeError("base failed")

    with pytest.raises(RuntimeError, match="base failed"):
        call_base_config(config_registry, failing)
    assert config_registry.model_registry is original
    config, converters = call_base_config(config_registry, _lora_base)
    assert [type(c) for c in converters] == [LoRAConverter.Config] and config_registry.model_registry is original


# ------------------------------------------------- frozen parameters and Gefen
class _Adapted(nn.Module):
    """A frozen base matrix (as LoRA's) beside two trainable adapter matrices."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(64, 64, bias=False).requires_grad_(False)
        self.lora_a = nn.Linear(64, 8, bias=False)
        self.lora_b = nn.Linear(8, 64, bias=False)


def test_frozen_parameters_hold_no_gefen_state_and_do_not_block_the_agreement():
    """Agreed blocking refuses a Gefen parameter without a gradient on the
    first step; a frozen one is no Gefen parameter at all (torchtitan's param
    groups take ``requires_grad`` ones only), so it never reaches the
    agreement, holds no state and is not stepped."""
    model = _Adapted()
    frozen = model.base.weight.detach().clone()
    opt = GefenOptimizersContainer.Config(name="Gefen", lr=1e-2).build(model_parts=[model])
    (optim,) = opt.optimizers_of("Gefen")
    assert [n for n, _, _ in gx.named_params(optim)] == ["lora_a.weight", "lora_b.weight"]
    for step in range(2):
        for p in (model.lora_a.weight, model.lora_b.weight):
            p.grad = torch.randn_like(p) * (step + 1)
        opt.step()
        opt.zero_grad()
    assert model.base.weight.grad is None and model.base.weight not in optim.state
    assert torch.equal(model.base.weight, frozen)
    assert gx.codebook(optim) is not None  # the agreement ran, and set the codebook
    for p in (model.lora_a.weight, model.lora_b.weight):
        assert gx.gefen_read(optim, p) is not None
    assert opt.state_bytes()[1] == 64 * 8 * 2  # elements: the adapters only
    assert not any(k.startswith("gefen/") and "base" in k for k in opt.state_dict())
