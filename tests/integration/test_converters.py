"""A LoRA recipe (torchtitan's LoRA converter, named in [[model.converters]]
over the debug recipe) trained with Gefen on gloo, checkpointed at 2 ranks
and resumed at 1, through the reshard validation (``gefen-titan validate``,
as test_validate_reshard.py runs it): the state after the load is bit-exact
(every checkpoint entry and parameter, frozen ones included, gathered to
global tensors, and every rank's periods and codebook). Only the adapters
hold Gefen state: the frozen base weights never reach the agreement (it ran
on 2 ranks and on 1 without a parameter lacking its gradient) and are the
same after the resumed steps as at the save.

The LoRA config lives here, not in a shipped recipe: on CPU it needs
``tests.helpers.lora_attention`` (the recipes' SDPA override does not claim
LoRA's frozen FlexAttention config), and a shipped CPU recipe would need a
stored reference curve (test_recipe_regression.py). About 100 s on 2 cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from gefen_titan.recipe import load_recipe
from tests.helpers import processes

ROOT = Path(__file__).resolve().parents[2]
S, K = 3, 2

RECIPE = f"""\
[job]
extends = "{ROOT / 'recipes' / 'llama_gefen.toml'}"

[[model.converters]]
kind = "lora"
rank = 8
alpha = 16.0
target_modules = ["wqkv", "wo", "w1", "w2", "w3"]

[override]
imports = ["tests.helpers.lora_attention.sdpa_attention_any_flex"]

[training]
seq_len = 64
"""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    recipe = base / "llama_gefen_lora.toml"
    recipe.write_text(RECIPE)
    out = base / "validate"
    # -m from the checkout's root: the ranks import the override as tests.helpers...
    cmd = [sys.executable, "-m", "gefen_titan", "validate", "--recipe", str(recipe), "--backend", "gloo",
           "--no-dropped-state", "--steps-before", str(S), "--steps-after", str(K), "--global-batch", "4",
           "--local-batch", "2", "--pairs", "2:1", "--out", str(out), *processes.validate_launcher()]
    proc = processes.run(cmd, cwd=ROOT, timeout=850)
    report = out / "report.json"
    return proc, (json.loads(report.read_text()) if report.exists() else {}), out, str(recipe)


def _adapters(recipe: str) -> tuple[int, int]:
    """(adapter elements, all elements) of the recipe's model: LoRA's trainable and every parameter."""
    with torch.device("meta"):
        model = load_recipe(recipe, world_size=1).config.model_spec.model.build()
    params = list(model.named_parameters())
    assert any(p.requires_grad for _, p in params) and all(
        ("lora_a" in n or "lora_b" in n) == p.requires_grad for n, p in params)
    return sum(p.numel() for _, p in params if p.requires_grad), sum(p.numel() for _, p in params)


def test_lora_recipe_resumes_bit_exact_at_another_size(lora_run):
    proc, report, _, recipe = lora_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (pair,) = report["pairs"]
    assert pair["pair"] == "2->1" and pair["failures"] == []
    st = pair["state"]
    assert st["blocking"] == "agreed" and st["exact"] and st["params_exact"], st
    assert not st["problems"] and st["entries_differ"] == []
    assert st["momentum_rel_l2"] == st["vmean_rel_l2"] == st["first_update_rel_l2"] == 0.0
    assert sorted(int(s) for s in pair["resumed_losses"]) == list(range(S + 1, S + K + 1))
    adapters, total = _adapters(recipe)
    assert report["parameters"] == total
    assert st["dense_elements"] == adapters < total / 10  # Gefen state for the adapters only


def _tensors(folder: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import load

    md = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    out = {k: torch.empty(md[k].size, dtype=md[k].properties.dtype) for k in keys}
    load(out, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return out


def test_frozen_weights_stay_frozen_through_the_resume(lora_run):
    """The base weights after the resumed steps at 1 rank are those saved at 2; the adapters moved."""
    proc, _, out, _ = lora_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    saved, resumed = out / "ref-2" / "checkpoint" / f"step-{S}", out / "2-to-1" / "checkpoint" / f"step-{S + K}"
    names = [k for k in FileSystemReader(str(resumed)).read_metadata().state_dict_metadata if k.endswith("weight")]
    frozen = [k for k in names if "lora_" not in k]
    lora = [k for k in names if "lora_b" in k]  # lora_b starts at zero: any step moves it
    assert frozen and lora
    before, after = _tensors(saved, frozen + lora), _tensors(resumed, frozen + lora)
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(not torch.equal(before[k], after[k]) for k in lora)
