"""``[optimizer] name = "GefenMuonHybrid"`` (gefen_titan.optim.hybrid): the
routing by module on torchtitan's Llama and on a model with an ``output`` head
and a fused ``wqkv``, wrapped and split into pipeline stages; the defaults
against gefen-x's own GefenMuonHybrid (its signature, read with inspect, and
the groups it builds); explicit param groups; refused keys; the kinds
check's hints."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from gefen import GefenMuonHybrid
from gefen.gefen_muon import NS_SCHEDULES
from gefen.params import split_params_for_muon
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchtitan.components.optimizer import ParamGroupConfig

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import hybrid, param_groups, registry
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen_muon import keys as muon_keys
from gefen_titan.recipe import RecipeError, load_recipe
from gefen_titan.recipe.cli import load_cli

Config = GefenOptimizersContainer.Config
H = hybrid.HybridOptions
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ models
class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=True)  # fused: one hidden matrix (and a bias)
        self.wo = nn.Linear(dim, dim, bias=False)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.pos = nn.Embedding(4, dim)  # an embedding inside a block: still the backup's


class Net(nn.Module):
    """torchtitan's layout with the head named ``output`` (older torchtitan)."""

    def __init__(self, dim=8, vocab=16, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


HIDDEN = ("attention.wqkv.weight", "attention.wo.weight", "w1.weight")


def net_split(layers=range(2)):
    muon = [f"layers.{i}.{n}" for i in layers for n in HIDDEN]
    return muon


def llama_debug_on_meta() -> nn.Module:
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        return model_registry("debugmodel").model.build()


# ------------------------------------------------------------------ routing
def test_routes_torchtitans_llama_by_module():
    model = llama_debug_on_meta()
    muon, backup = hybrid.route(model)
    per_block = ("attention.qkv_linear.wqkv.weight", "attention.wo.weight", "feed_forward.w1.weight",
                 "feed_forward.w2.weight", "feed_forward.w3.weight")
    assert muon == [f"layers.{i}.{n}" for i in range(6) for n in per_block]
    assert backup == ["tok_embeddings.weight", *[f"layers.{i}.{n}" for i in range(6)
                                                 for n in ("attention_norm.weight", "ffn_norm.weight")],
                      "norm.weight", "lm_head.weight"]
    assert isinstance(model.get_submodule("layers.0.attention.qkv_linear.wqkv"), nn.Linear)  # the fused one


def test_routes_output_head_and_fused_wqkv_by_module_where_names_would_not():
    model = Net()
    muon, backup = hybrid.route(model)
    assert muon == net_split()
    assert "output.weight" in backup and "tok_embeddings.weight" in backup
    assert {"layers.0.attention.wqkv.bias", "layers.0.pos.weight", "layers.1.ffn_norm.weight"} <= set(backup)
    assert sorted(muon + backup) == sorted(n for n, _ in model.named_parameters())
    # gefen-x's name heuristics send this head to Muon: what the module routing is for.
    gefen_x_muon = {n for n, _ in split_params_for_muon(model)[0]}
    assert "output.weight" in gefen_x_muon


def test_wrapped_blocks_and_frozen_parameters_route_alike():
    model = Net()
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block)  # torchtitan's activation checkpointing
    assert "layers.0._checkpoint_wrapped_module.w1.weight" in dict(model.named_parameters())
    muon, backup = hybrid.route(model)
    assert muon == net_split() and "output.weight" in backup  # canonical FQNs
    model.layers["1"]._checkpoint_wrapped_module.w1.weight.requires_grad_(False)
    muon, backup = hybrid.route(model)
    assert "layers.1.w1.weight" not in muon + backup


def test_container_builds_the_split_with_exact_name_patterns():
    model = Net()
    opt = Config(name="GefenMuonHybrid", lr=1e-3, implementation="for-loop").build(model_parts=[model])
    muon, backup = opt.optimizers
    assert gx.is_gefen_muon(muon) and gx.is_gefen(backup)
    assert [n for g in muon.param_groups for n in g["param_names"]] == net_split()
    assert sorted(n for g in backup.param_groups for n in g["param_names"]) == sorted(hybrid.route(model)[1])


def test_pipeline_stages_route_alike_and_a_stage_may_lack_a_routed_set():
    """Stages keep the blocks' keys; a stage with no matrix (here: only the
    head) builds its backup alone, one with matrices only its GefenMuon alone."""
    first, last = Net(layers=2), Net(layers=2)
    first.norm = first.output = None
    del first.layers["1"]
    last.tok_embeddings = None
    del last.layers["0"]
    head = Net(layers=1)
    head.tok_embeddings = None
    head.layers = nn.ModuleDict()
    matrices = nn.Module()  # a stage with hidden matrices only: no backup group there
    matrices.layers = nn.ModuleDict({"2": nn.Linear(8, 8, bias=False)})
    opt = Config(name="GefenMuonHybrid", implementation="for-loop").build(model_parts=[first, last, head, matrices])
    kinds = [(type(o).__name__, [n for g in o.param_groups for n in g["param_names"]]) for o in opt.optimizers]
    assert [k for k, _ in kinds] == ["ShardedGefenMuon", "Gefen", "ShardedGefenMuon", "Gefen", "Gefen",
                                     "ShardedGefenMuon"]
    assert kinds[0][1] == net_split([0]) and kinds[2][1] == net_split([1])
    assert kinds[4][1] == ["norm.weight", "output.weight"] and kinds[5][1] == ["layers.2.weight"]


def test_registered_as_a_composite_not_an_optimizer():
    spec = registry.composite("GefenMuonHybrid")
    assert spec.bind is hybrid.bind and spec.refused_keys is hybrid.REFUSED and spec.kind_hint is hybrid.kind_hint
    assert "GefenMuonHybrid" not in registry.names() and registry.get("GefenMuonHybrid") is None
    with pytest.raises(NotImplementedError):  # no factory: no optimizer of that type is ever built
        GefenOptimizersContainer._resolve_optimizer_factory("GefenMuonHybrid")


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="no hidden matrix"):
        Config(name="GefenMuonHybrid").build(model_parts=[nn.Sequential(nn.Linear(4, 4))])


# ------------------------------------------------------------------ defaults
def test_every_gefen_x_keyword_is_a_field_with_its_default_a_shared_key_or_refused():
    signature = inspect.signature(GefenMuonHybrid.__init__).parameters
    keywords = {k: p.default for k, p in signature.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert gx.hybrid_defaults() == {k: v for k, v in keywords.items() if v is not inspect.Parameter.empty}
    assert keywords["lr"] is inspect.Parameter.empty  # gefen-x requires it: [optimizer] lr
    classes = [set(hybrid.OPTION_KEYS), set(hybrid.SHARED_KEYS), set(hybrid.REFUSED)]
    assert set().union(*classes) == set(keywords), "a gefen-x keyword is neither supported nor refused"
    assert sum(len(c) for c in classes) == len(keywords), "a keyword is in two classes"
    config = Config()
    for key in hybrid.OPTION_KEYS:
        ours = getattr(config.hybrid, key)
        assert (tuple(ours) if isinstance(ours, list) else ours) == keywords[key], key
    assert set(hybrid.REFUSED) >= set(gx.MUON_REFUSED) - {"ns_schedule"}


def test_tuned3_becomes_its_coefficient_list():
    tuned3 = [[float(x) for x in abc] for abc in NS_SCHEDULES["tuned3"]]
    assert gx.ns_schedule_coefficients("tuned3") == tuned3 and len(tuned3) == 3
    (muon, *_) = param_groups.resolved_param_groups(Config(name="GefenMuonHybrid"))
    assert muon.optimizer_kwargs["ns_coefficients"] == tuned3 and muon.optimizer_kwargs["ns_steps"] == 3
    config = Config(name="GefenMuonHybrid", hybrid=H(ns_schedule="standard", ns_steps=4))
    (muon, *_) = param_groups.resolved_param_groups(config)
    assert "ns_coefficients" not in muon.optimizer_kwargs and muon.optimizer_kwargs["ns_steps"] == 4


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_groups_equal_gefen_xs_own_hybrid(backup):
    """The same shared values into gefen-x's GefenMuonHybrid and into ours: every
    group key GefenMuon and the backup read is the same."""
    shared = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    model = Net()
    muon, rest = hybrid.route(model)
    params = dict(model.named_parameters())
    theirs = GefenMuonHybrid([(n, params[n]) for n in muon], [(n, params[n]) for n in rest], fused=False,
                             backup_optimizer=backup, backup_lr=1e-3, **shared)
    ours = Config(name="GefenMuonHybrid", hybrid=H(backup_optimizer=backup, backup_lr=1e-3), implementation="for-loop",
                  **shared).build(model_parts=[model])
    ours_muon, ours_backup = ours.optimizers
    keys = [k for k in gx.MUON_GROUP_KEYS if k != "ns_coefficients"]
    (a,), (b,) = theirs.muon.param_groups, ours_muon.param_groups
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert [list(x) for x in a["ns_coefficients"]] == b["ns_coefficients"]
    assert type(ours_backup) is type(theirs.backup)
    backup_keys = ("lr", "eps", "weight_decay", "beta1", "beta2") if backup == "gefen" else (
        "lr", "eps", "weight_decay", "betas")
    (a,), (b,) = theirs.backup.param_groups, ours_backup.param_groups
    assert {k: a[k] for k in backup_keys} == {k: b[k] for k in backup_keys}


def test_weight_decay_split_and_no_decay_substrings():
    model = Net()
    config = Config(name="GefenMuonHybrid", weight_decay=0.1, implementation="for-loop",
                    hybrid=H(muon_weight_decay=0.2, backup_lr=5e-4, no_decay_substrings=["NORM", "bias"]))
    muon, backup = config.build(model_parts=[model]).optimizers
    assert muon.param_groups[0]["weight_decay"] == 0.2
    no_decay, decay = backup.param_groups
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert all("norm" in n or n.endswith("bias") for n in no_decay["param_names"])
    assert sorted(decay["param_names"]) == ["layers.0.pos.weight", "layers.1.pos.weight", "output.weight",
                                            "tok_embeddings.weight"]
    assert no_decay["lr"] == decay["lr"] == 5e-4


def test_adamw_backup():
    muon, backup = Config(name="GefenMuonHybrid", hybrid=H(backup_optimizer="adamw"), implementation="for-loop").build(
        model_parts=[Net()]).optimizers
    assert gx.is_gefen_muon(muon) and type(backup) is torch.optim.AdamW


# ------------------------------------------------------------------ explicit groups, bad keys
def test_explicit_param_groups_win():
    groups = [ParamGroup(pattern=r"^layers\.\d+\.w1\.", optimizer_name="GefenMuon"),
              ParamGroup(pattern=".*", optimizer_name="AdamW")]
    config = Config(name="GefenMuonHybrid", lr=1e-3, param_groups=groups)
    assert [(g.pattern, g.optimizer_name) for g in param_groups.resolved_param_groups(config)] == \
        [(g.pattern, g.optimizer_name) for g in groups]
    assert not any(isinstance(g, hybrid.RoutedGroup) for g in param_groups.resolved_param_groups(config))
    muon, adamw = config.build(model_parts=[Net()]).optimizers
    assert muon.param_groups[0]["param_names"] == ["layers.0.w1.weight", "layers.1.w1.weight"]
    # A group without optimizer_name cannot be "GefenMuonHybrid"; hybrid keys do nothing beside groups.
    with pytest.raises(ValueError, match=r"param_groups\[0\]: GefenMuonHybrid is no optimizer of a param group"):
        param_groups.check_param_groups(Config(name="GefenMuonHybrid", param_groups=[ParamGroup(pattern=".*")]))
    with pytest.raises(ValueError, match="hybrid.muon_lr: has no effect.*param_groups"):
        param_groups.check_param_groups(Config(name="GefenMuonHybrid", param_groups=groups, hybrid=H(muon_lr=1e-3)))
    with pytest.raises(ValueError, match="hybrid.backup_optimizer, hybrid.normuon: have no effect.*'Gefen'"):
        param_groups.check_param_groups(Config(name="Gefen", hybrid=H(backup_optimizer="adamw", normuon=False)))


def test_bad_keys_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="optimizer.hybrid.backup_optimizer must be 'gefen' or 'adamw', got 'sgd'"):
        H(backup_optimizer="sgd")
    with pytest.raises(ValueError, match=r"ns_schedule must be one of \['standard', 'tuned3', 'tuned4'\]"):
        param_groups.check_param_groups(Config(name="GefenMuonHybrid", hybrid=H(ns_schedule="tuned9")))
    with pytest.raises(ValueError, match="needs optimizer.blocking.mode"):
        param_groups.check_param_groups(Config(name="GefenMuonHybrid", blocking=BlockingOptions(mode="per_rank")))
    base = f'[job]\nextends = "{ROOT / "recipes" / "llama_gefen.toml"}"\n[optimizer]\nname = "GefenMuonHybrid"\n'
    cases = {
        'backup_optimizer = "sgd"': r"backup_optimizer: must be one of \['gefen', 'adamw'\], got 'sgd'",
        "fp8_ns = true": "fp8_ns: gefen-x's GefenMuonHybrid option is not supported: fp8 Newton-Schulz",
        'backup_substrings = ["head"]': "gefen-titan routes by module, not by name substrings",
        "backup_1d_period_one = true": "optimizer.gefen.force_1d_period_one",
        "fused = false": "optimizer.implementation",
        "[optimizer.hybrid]\ncautious = true": "hybrid.cautious: gefen-x's GefenMuonHybrid option is not supported",
    }
    for i, (line, message) in enumerate(cases.items()):
        path = tmp_path / f"r{i}.toml"
        path.write_text(base + line + "\n")
        with pytest.raises(RecipeError, match=message):
            load_recipe(path, world_size=2)
    with pytest.raises(RecipeError, match="command line: --optimizer.cautious: gefen-x's GefenMuonHybrid option is "
                       "not supported: cautious masking needs the full gradient"):
        load_cli(["--job.config", str(ROOT / "recipes" / "llama_gefen_muon_hybrid.toml"), "--optimizer.cautious",
                  "true"], world_size=2)


def test_kind_hints_name_the_setting():
    hybrid_gefen = Config(name="GefenMuonHybrid")
    hybrid_adamw = Config(name="GefenMuonHybrid", hybrid=H(backup_optimizer="adamw"))
    assert 'backup_optimizer = "gefen"' in hybrid.kind_hint(hybrid_adamw, "Gefen", "AdamW")
    assert 'backup_optimizer = "adamw"' in hybrid.kind_hint(hybrid_gefen, "AdamW", "Gefen")
    assert 'name = "GefenMuonHybrid"' in hybrid.kind_hint(Config(name="Gefen"), "GefenMuon", "Gefen")
    assert "--optimizer.name Gefen" in hybrid.kind_hint(hybrid_gefen, "Gefen", "GefenMuon")
    mixed = Config(name="Gefen", param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW")])
    assert hybrid.kind_hint(mixed, "Gefen", "AdamW") == ""


@pytest.mark.parametrize("saved_backup,live_backup", [("gefen", "adamw"), ("adamw", "gefen")])
def test_kinds_check_refuses_the_other_backup_naming_backup_optimizer(saved_backup, live_backup):
    """``kinds_refusal`` (the container's load preparation) on a hybrid
    checkpoint's keys: a Gefen backup's records, or AdamW's flat
    ``param_groups.<fqn>.lr`` entries, against the other backup live."""
    import json

    from gefen_titan.optim import checkpointing

    records = {muon_keys.muon_optimizer_key("0"): json.dumps({"params": [{"fqn": "layers.0.w1.weight"}]})}
    flat = []
    if saved_backup == "gefen":
        records[gefen_keys.optimizer_key("1")] = json.dumps({"params": [{"fqn": "norm.weight"}]})
    else:
        flat = ["param_groups.norm.weight.lr", "state.norm.weight.exp_avg"]
    ctx = checkpointing.LoadContext("ckpt", {k: None for k in [*records, *flat]}, records, None)
    config = Config(name="GefenMuonHybrid", hybrid=H(backup_optimizer=live_backup))
    live = {"layers.0.w1.weight": "GefenMuon", "norm.weight": hybrid.BACKUPS[live_backup]}
    was, now = hybrid.BACKUPS[saved_backup], hybrid.BACKUPS[live_backup]
    refusal = checkpointing.kinds_refusal(ctx, live, registry.record_kinds(),
                                          hint=lambda w, n: hybrid.kind_hint(config, w, n))
    assert re.search(rf"1 parameter\(s\) \(norm.weight\) were saved by {was} and the recipe gives them to {now}: "
                     rf'set optimizer.hybrid.backup_optimizer = "{saved_backup}"', refusal), refusal
    same = {**live, "norm.weight": was}  # the backup that wrote it: nothing to refuse
    assert checkpointing.kinds_refusal(ctx, same, registry.record_kinds(),
                                       hint=lambda w, n: hybrid.kind_hint(config, w, n)) is None


def test_kinds_check_refuses_a_hybrid_checkpoint_in_a_gefen_recipe():
    import json

    from gefen_titan.optim import checkpointing

    records = {muon_keys.muon_optimizer_key("0"): json.dumps({"params": [{"fqn": "layers.0.w1.weight"}]}),
               gefen_keys.optimizer_key("1"): json.dumps({"params": [{"fqn": "norm.weight"}]})}
    ctx = checkpointing.LoadContext("ckpt", {k: None for k in records}, records, None)
    config = Config(name="Gefen")
    refusal = checkpointing.kinds_refusal(ctx, {"layers.0.w1.weight": "Gefen", "norm.weight": "Gefen"},
                                          registry.record_kinds(), hint=lambda w, n: hybrid.kind_hint(config, w, n))
    assert re.search(r"\(layers.0.w1.weight\) were saved by GefenMuon and the recipe gives them to Gefen: if the "
                     r'run that wrote it was \[optimizer\] name = "GefenMuonHybrid", set that', refusal), refusal


@pytest.mark.parametrize("module, flavor", [("deepseek_v3", "debugmodel"), ("qwen3", "debugmodel_moe")])
def test_routes_torchtitans_moe_experts_to_gefen_muon_and_the_router_to_the_backup(module, flavor):
    """The routed experts' grouped weights (one Muon matrix per expert) and the shared experts' and
    attention's matrices go to GefenMuon; the router's gate goes to the backup, as torchtitan's own
    MoE param groups give it Adam; the experts' load-balancing bias is a buffer, no parameter."""
    import importlib

    registry_of = importlib.import_module(f"torchtitan.models.{module}").model_registry
    with torch.device("meta"):
        model = registry_of(flavor).model.build()
    muon, backup = hybrid.route(model)
    experts = [n for n, p in model.named_parameters() if ".moe.routed_experts." in n]
    assert experts and all(p.dim() == 3 for n, p in model.named_parameters() if n in experts)
    assert set(experts) <= set(muon)
    gates = [n for n in backup if ".moe.router.gate." in n]
    assert gates and not any(".router." in n for n in muon)
    params = dict(model.named_parameters())
    assert all(params[n].dim() in (2, 3) for n in muon)
    assert not any("tok_embeddings" in n or "lm_head" in n or "norm" in n for n in muon)
    assert sorted(muon + backup) == sorted(params)
    shared = [n for n in muon if ".moe.shared_experts." in n]
    assert (module == "deepseek_v3") == bool(shared)
