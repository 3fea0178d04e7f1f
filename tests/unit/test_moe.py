"""Mixture-of-experts models (docs/moe.md): the shipped MoE recipes build what
they say, the small MoE flavors are torchtitan's models in all but size, and
torchtitan's load-balancing hook runs on gefen-titan's optimizer container
exactly once per real optimizer step.

torchtitan updates each MoE layer's ``expert_bias_E`` (a persistent buffer:
it is in the model's state dict, so in every checkpoint) from the
``tokens_per_expert_E`` counted in the step's forwards (non-persistent), in an
optimizer step pre-hook registered by ``register_moe_load_balancing_hook``
(the model spec's ``post_optimizer_build_fn``), and zeroes the counts there.
The hook is the container's own: it must fire on ``container.step()``, with
every optimizer kind, and never in the zero-gradient ``init_optim_state`` step
that ``state_dict()`` (and a load) runs on the flat optimizers (AdamW groups),
which would move the bias and drop the step's counts. (That the bias survives
a real save and resume: tests/integration/test_moe_load_balancing.py.)
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.distributed import ParallelDims
from torchtitan.models import deepseek_v3, qwen3

import gefen_titan.patches as P
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.recipe import RecipeError, load_recipe, moe_flavors
from gefen_titan.recipe.cli import load_cli

ROOT = Path(__file__).resolve().parents[2]
PKG = P.__name__
cpu_grouped_mm = importlib.import_module(f"{PKG}.cpu_grouped_mm")
sdpa_attention = importlib.import_module(f"{PKG}.sdpa_attention")

# recipe -> (torchtitan module, base config, flavor, parameters, routed-expert parameters, MoE layers, experts)
MOE_RECIPES = {
    "dsv3_gefen.toml": ("deepseek_v3", "deepseek_v3_debugmodel", "debugmodel_small", 8_430_336, 4_718_592, 3, 8),
    "qwen3_moe_gefen.toml": ("qwen3", "qwen3_moe_debug", "debugmodel_moe_8e", 8_137_472, 6_291_456, 4, 8),
}
OVERRIDES = ["gefen_titan.patches.sdpa_attention.sdpa_attention", "gefen_titan.patches.cpu_grouped_mm.cpu_grouped_mm"]


def _meta_model(spec):
    with torch.device("meta"):
        return spec.model.build()


def _moe_layers(model):
    return [b.moe for b in model.layers.values() if getattr(b, "moe_enabled", False)]


# ------------------------------------------------------------------ recipes
@pytest.mark.parametrize("name", MOE_RECIPES)
def test_moe_recipe_builds_its_model_and_cpu_settings(name):
    module, base, flavor, numel, experts, moe_layers, num_experts = MOE_RECIPES[name]
    recipe = load_recipe(ROOT / "recipes" / name, world_size=2)
    config = recipe.config
    assert (recipe.module, recipe.base_config, recipe.flavor) == (module, base, flavor)
    assert config.model_spec.name == module and config.model_spec.flavor == flavor
    assert config.optimizer.name == "Gefen" and config.optimizer.blocking.mode == "agreed"
    assert config.parallelism.expert_parallel_degree == 1 and config.parallelism.data_parallel_shard_degree == -1
    assert config.training.disable_cuda_graphs is True  # EP is then one flag (next test)
    assert config.training.mixed_precision_param == "float32" and config.activation_checkpoint is None
    assert config.dataloader.dataset == "gefen_tiny"
    assert list(config.override.imports) == OVERRIDES
    model = _meta_model(config.model_spec)
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == numel
    assert sum(p.numel() for n, p in params.items() if ".routed_experts.inner_experts." in n) == experts
    layers = _moe_layers(model)
    assert len(layers) == moe_layers
    assert {m.routed_experts.inner_experts.num_experts for m in layers} == {num_experts}
    # torchtitan's auxiliary-loss-free load balancing is on: the bias is a persistent buffer.
    assert all(m.load_balance_coeff == 1e-3 for m in layers)
    assert all("expert_bias_E" in dict(m.named_buffers()) for m in layers)
    assert not any("tokens_per_expert_E" in k for k in model.state_dict())
    assert sum("expert_bias_E" in k for k in model.state_dict()) == moe_layers


@pytest.mark.parametrize("name", MOE_RECIPES)
def test_expert_parallelism_is_one_flag(name):
    path = str(ROOT / "recipes" / name)
    config = load_cli(["--job.config", path, "--parallelism.expert_parallel_degree", "2"], world_size=2).config
    assert config.parallelism.expert_parallel_degree == 2
    # What the recipe's disable_cuda_graphs = true spares the user: torchtitan's refusal, on CPU too.
    with pytest.raises(RecipeError, match=r"CUDA graphs support only expert parallel token dispatcher .* set "
                                          r"--training.disable_cuda_graphs"):
        load_cli(["--job.config", path, "--parallelism.expert_parallel_degree", "2",
                  "--training.no-disable-cuda-graphs"], world_size=2)


@pytest.mark.parametrize("flags,world,message", [
    # torchtitan: "ValueError: The product of mesh_sizes=(1, 1, 0, 4) is 0 ..." at the mesh build
    (["--parallelism.expert_parallel_degree", "4"], 2,
     r"expert_parallel_degree \(4\) must divide data_parallel_shard_degree\(2\) \* context_parallel_degree\(1\) "
     r"\* tensor_parallel_degree\(1\) = 2"),
    # torchtitan: "RuntimeError: shape '[3, -1]' is invalid for input of size 8" in the first forward
    (["--parallelism.expert_parallel_degree", "3"], 3, r"expert_parallel_degree \(3\) does not divide the 8 experts"),
    (["--parallelism.expert_parallel_degree", "4", "--model.flavor", "debugmodel_moe_2e"], 4,
     r"expert_parallel_degree \(4\) does not divide the 2 experts of qwen3 debugmodel_moe_2e"),
    (["--parallelism.expert_parallel_degree", "0"], 2, r"expert_parallel_degree must be >= 1, got 0"),
])
def test_expert_parallel_degrees_torchtitan_fails_on_late_are_refused_first(flags, world, message):
    with pytest.raises(RecipeError, match=message):
        load_cli(["--job.config", str(ROOT / "recipes" / "qwen3_moe_gefen.toml"), *flags], world_size=world)


def test_expert_parallelism_on_a_model_without_experts_is_refused():
    with pytest.raises(RecipeError, match=r"llama3 debugmodel has no mixture-of-experts layers: the degree would "
                                          r"have no effect"):
        load_cli(["--job.config", str(ROOT / "recipes" / "llama_gefen.toml"), "--parallelism.expert_parallel_degree",
                  "2", "--training.disable_cuda_graphs"], world_size=2)


def test_expert_parallel_degrees_that_split_ranks_and_experts_pass():
    path = str(ROOT / "recipes" / "qwen3_moe_gefen.toml")
    for flags, world in ((["--parallelism.expert_parallel_degree", "4"], 4),
                         (["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                           "--parallelism.data_parallel_shard_degree", "1"], 2),
                         (["--parallelism.expert_parallel_degree", "8", "--parallelism.data_parallel_shard_degree",
                           "4", "--parallelism.tensor_parallel_degree", "2"], 8)):
        assert load_cli(["--job.config", path, *flags], world_size=world).config.parallelism.expert_parallel_degree > 1


@pytest.mark.parametrize("name", MOE_RECIPES)
def test_torchtitans_own_flavor_is_one_flag_away(name):
    module = MOE_RECIPES[name][0]
    theirs = {"deepseek_v3": "debugmodel", "qwen3": "debugmodel_moe"}[module]
    config = load_cli(["--job.config", str(ROOT / "recipes" / name), "--model.flavor", theirs], world_size=2).config
    assert config.model_spec.flavor == theirs


# ------------------------------------------------------------------ flavors
def _shape_of_model(model) -> set[str]:
    """Parameter and buffer names with the layer numbers taken out: the model's shape of module tree."""
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return {re.sub(r"\.\d+\.", ".N.", n) for n in names}


@pytest.mark.parametrize("package,ours,theirs", [
    (qwen3, "debugmodel_moe_8e", "debugmodel_moe"),
    (qwen3, "debugmodel_moe_2e", "debugmodel_moe"),
    (deepseek_v3, "debugmodel_small", "debugmodel"),
])
def test_small_flavors_are_torchtitans_models_in_all_but_size(package, ours, theirs):
    moe_flavors.register_flavors()
    mine, shipped = _meta_model(package.model_registry(ours)), _meta_model(package.model_registry(theirs))
    assert type(mine) is type(shipped)
    assert _shape_of_model(mine) == _shape_of_model(shipped)
    assert [type(b) for b in mine.layers.values()][-1] is type(list(shipped.layers.values())[-1])
    for a, b in zip(_moe_layers(mine), _moe_layers(shipped)):
        assert type(a.router) is type(b.router) and a.router.score_func == b.router.score_func
        assert a.router.route_norm == b.router.route_norm


@pytest.mark.parametrize("flavor,num_experts,top_k", [("debugmodel_moe_8e", 8, 2), ("debugmodel_moe_2e", 2, 1)])
def test_small_qwen3_flavors_experts_and_routing(flavor, num_experts, top_k):
    # 2 experts: torchtitan's FSDP cuts them on dim 1 at efsdp * ep > 2 (4 ranks; docs/moe.md).
    # top-1 there, so that routing still chooses (top-2 of 2 never moves the bias).
    moe_flavors.register_flavors()
    layers = _moe_layers(_meta_model(qwen3.model_registry(flavor)))
    assert len(layers) == 4
    assert {(m.routed_experts.inner_experts.num_experts, m.router.top_k) for m in layers} == {(num_experts, top_k)}


def test_register_flavors_is_idempotent_and_refuses_to_shadow(monkeypatch):
    moe_flavors.register_flavors()
    moe_flavors.register_flavors()
    monkeypatch.setitem(qwen3.qwen3_configs, "debugmodel_moe_8e", qwen3.qwen3_configs["debugmodel_moe"])
    with pytest.raises(RuntimeError, match="already has a qwen3 flavor 'debugmodel_moe_8e'"):
        moe_flavors.register_flavors()


# ------------------------------------------------------------------ the load-balancing hook on our container
@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo world and torchtitan's meshes for it (the hook asks for the loss mesh)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    dims.build_mesh()
    yield dims
    if owned:
        dist.destroy_process_group()


def _tiny_moe_model():
    """A Qwen3 MoE from torchtitan's builders, tiny, so that its Gefen steps take a moment."""
    config = moe_flavors.qwen3_moe(num_experts=4, top_k=1, dim=64, n_layers=2, n_heads=2, n_kv_heads=1,
                                   head_dim=32, vocab=256, moe_hidden_dim=64)
    sdpa_attention.use_sdpa_attention(config, cpu_only=False)
    cpu_grouped_mm.use_cpu_grouped_mm(config, cpu_only=False)
    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _forward_backward(model, seed):
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().square().mean().backward()


def _expected_bias(bias, counts, coeff=1e-3):
    """torchtitan's update (register_moe_load_balancing_hook), for the test's expectations."""
    delta = coeff * torch.sign(counts.mean() - counts)
    return bias + (delta - delta.mean())


@pytest.mark.parametrize("config", [
    GefenOptimizersContainer.Config(name="Gefen", lr=1e-2),
    GefenOptimizersContainer.Config(name="Gefen", lr=1e-2, param_groups=[
        ParamGroup(pattern="norm", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
        ParamGroup(pattern=".*", optimizer_name="Gefen")]),
    GefenOptimizersContainer.Config(name="GefenMuonHybrid", lr=1e-2),
], ids=["Gefen", "Gefen+AdamW", "GefenMuonHybrid"])
def test_load_balancing_hook_fires_on_every_step_and_never_in_init_optim_state(one_rank, config):
    model = _tiny_moe_model()
    container = config.build(model_parts=[model])
    register_moe_load_balancing_hook(container, [model], one_rank)
    layers = _moe_layers(model)
    assert all(torch.count_nonzero(m.expert_bias_E) == 0 for m in layers)
    for step in range(3):
        container.zero_grad()
        _forward_backward(model, step)
        counts = [m.tokens_per_expert_E.clone() for m in layers]
        biases = [m.expert_bias_E.clone() for m in layers]
        assert all(c.sum() == 2 * 32 for c in counts)  # top-1: one expert per token
        # A checkpoint save in between: init_optim_state's zero-gradient step (on
        # the AdamW group) must neither move the bias nor drop the counts.
        container.state_dict()
        for m, c, b in zip(layers, counts, biases, strict=True):
            assert torch.equal(m.tokens_per_expert_E, c) and torch.equal(m.expert_bias_E, b)
        container.step()
        for m, c, b in zip(layers, counts, biases, strict=True):
            assert torch.equal(m.expert_bias_E, _expected_bias(b, c)), f"step {step + 1}"
            assert torch.count_nonzero(m.tokens_per_expert_E) == 0
    # The bias moved (the routing is uneven at this init), and it is what the model routes with.
    assert any(torch.count_nonzero(m.expert_bias_E) for m in layers)
