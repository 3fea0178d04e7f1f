"""The optimizer's load path: one small collective read of the records per load, and a third
optimizer kind added as a folder of its own (``tests/kinds/variant/``) and one ``register`` call: no
package code.

Both save a real checkpoint and resume it with ``GefenCheckpointManager``
(``tests.helpers.tiny_checkpoint.manager``: the train state, a data loader,
an LR scheduler beside the model and the optimizer), in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import kinds, schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.convert import convert
from gefen_titan.ckpt_tools.inspection import inspect_checkpoint
from gefen_titan.ckpt_tools.inspection import render as render_inspection
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from gefen_titan.ckpt_tools.view import CkptError
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import registry
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.recipe import load_recipe
from tests.helpers.tiny_checkpoint import manager
from tests.kinds.variant import entry as variant_entry
from tests.kinds.variant.options import VariantOptions
from tests.kinds.variant.sharded import Variant

ROOT = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.attn = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 32, bias=False)

    def forward(self, x):
        return self.out(self.norm(self.attn(x)))


def _train(opt, model, steps=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _save(opt, model, root):
    """Saved by ``GefenCheckpointManager`` as a run saves (step 1, under ``root/ckpt/step-1``)."""
    manager(root, model, opt).save(curr_step=1)
    return root / "ckpt" / "step-1"


def _load(opt, model, root, monkeypatch):
    """Loaded by ``GefenCheckpointManager`` as a run resumes; returns the keys of every DCP read it made."""
    reads = []
    real = dcp.load
    monkeypatch.setattr(dcp, "load", lambda *a, **kw: (reads.append(sorted(a[0])), real(*a, **kw))[1])
    try:
        assert manager(root, model, opt).load(step=1)
    finally:
        monkeypatch.setattr(dcp, "load", real)
    return reads


def _small_reads(reads):
    """The reads before the main one (the main read carries the model's entries)."""
    assert reads and "train_state" in reads[-1], reads
    return reads[:-1]


def _two_kinds_trained():
    """(config, model, optimizers): GefenMuon on the matrices, Gefen on the rest, 2 steps taken."""
    config = GefenOptimizersContainer.Config(param_groups=[
        ParamGroup(pattern=r"attn|out", optimizer_name="GefenMuon", optimizer_kwargs={"lr": 0.02}),
        ParamGroup(pattern=r".*", optimizer_name="Gefen", optimizer_kwargs={"lr": 1e-3})])
    model = Net()
    opt = config.build(model_parts=[model])
    _train(opt, model)
    return config, model, opt


def _same_state(a, b, read=gx.gefen_read):
    for (fqn, pa, _), (_, pb, _) in zip(gx.named_params(a), gx.named_params(b), strict=True):
        sa, sb = read(a, pa), read(b, pb)
        assert (sa is None) == (sb is None), fqn
        if sa is not None:
            assert sa.period == sb.period and sa.step == sb.step, fqn
            assert sa.factored == sb.factored, fqn
            names = ("v_row", "v_col") if sa.factored else ("vmean",)
            for name in ("codes", "magnitude", *names):
                assert torch.equal(getattr(sa, name), getattr(sb, name)), (fqn, name)
    assert torch.equal(gx.codebook(a), gx.codebook(b))


def test_a_load_reads_every_kinds_records_in_one_collective_read(tmp_path, monkeypatch):
    """Gefen and GefenMuon in one container: the load's planning (the kinds check, the
    format check, both adapters' plans) makes one small DCP read (it made four)."""
    config, model, opt = _two_kinds_trained()
    _save(opt, model, tmp_path)
    fresh_model = Net()
    fresh = config.build(model_parts=[fresh_model])
    reads = _small_reads(_load(fresh, fresh_model, tmp_path, monkeypatch))
    assert len(reads) == 1, reads
    (small,) = reads
    kinds = {schema.parse_key(k.partition(".")[2]).kind for k in small}
    assert kinds == {"header", "gefen", "codebook", "muon", "muon_codebook"}
    # Gefen's record keeps the key every version wrote: gefen/optimizer/{its first parameter}, key kind "gefen".
    gefen_first = schema.optimizer_id([fqn for fqn, _, _ in gx.named_params(opt.optimizers_of("Gefen")[0])])
    assert gefen_first == "norm.weight"
    assert [k for k in small if schema.parse_key(k.partition(".")[2]).kind == "gefen"] == [
        "optimizer.gefen/optimizer/norm.weight"]
    gefen_live, gefen_loaded = opt.optimizers_of("Gefen")[0], fresh.optimizers_of("Gefen")[0]
    _same_state(gefen_live, gefen_loaded)
    muon_live, muon_loaded = opt.optimizers_of("GefenMuon")[0], fresh.optimizers_of("GefenMuon")[0]
    for (fqn, pa, _), (_, pb, _) in zip(gx.named_params(muon_live), gx.named_params(muon_loaded), strict=True):
        sa, sb = gx.muon_read(muon_live, pa), gx.muon_read(muon_loaded, pb)
        assert torch.equal(sa.codes, sb.codes) and torch.equal(sa.magnitude, sb.magnitude), fqn


# ------------------------------------------------------------------ a third kind
@pytest.fixture
def variant_registered():
    """A third kind, laid out as a built-in one in a folder of its own (``tests/kinds/variant/``: its
    entry, options table, key rows, records, checkpoint description and state adapter): its registry
    entry is the one call it needs, registered for this test and dropped after."""
    registry.register(variant_entry.spec())
    yield
    registry.unregister("Variant")


def test_a_third_kind_is_one_entry_one_state_type_and_its_records(tmp_path, monkeypatch, variant_registered):
    # A recipe reaches its options table, [optimizer.variant], as any built-in kind's (the Config's tables
    # come from the registry: GefenOptimizersContainer.config_class()).
    config = load_recipe(ROOT / "recipes" / "llama_gefen.toml", {"optimizer": {
        "variant": {"deterministic": True},
        # Each group takes [optimizer] lr; the second [optimizer] name (Gefen).
        "param_groups": [{"pattern": "attn", "optimizer_name": "Variant"}, {"pattern": ".*"}]}},
        world_size=1).config.optimizer
    assert config.variant == VariantOptions(deterministic=True)
    model = Net()
    opt = config.build(model_parts=[model])
    _train(opt, model)
    step = _save(opt, model, tmp_path)
    keys = storage.read_metadata(step).state_dict_metadata
    variant = next(o for o in opt.optimizers if type(o) is Variant)
    assert gx.options(variant)["deterministic"] and not gx.options(opt.optimizers_of("Gefen")[0])["deterministic"]
    assert "optimizer.gefen/variant/attn.weight" in keys and "optimizer.gefen/variant_codebook/attn.weight" in keys
    assert gx.gefen_read(variant, next(gx.named_params(variant))[1]) is not None  # it stepped
    # The first step's agreement set its periods and learned its own codebook, from its own gradients.
    (gefen,) = opt.optimizers_of("Gefen")
    assert gx.period(variant, model.attn.weight) > 1
    assert gx.codebook(variant) is not None and not torch.equal(gx.codebook(variant), gx.codebook(gefen))

    # The offline tools know it by its description: inspect shows its rows, verify checks its records,
    # convert refuses it with its own reason.
    report = inspect_checkpoint(str(step))
    assert [o["kind"] for o in report["optimizers"]] == ["Gefen", "Variant"] and not report["warnings"]
    (row,) = [o for o in report["optimizers"] if o["kind"] == "Variant"]
    assert [p["fqn"] for p in row["params"]] == ["attn.weight"] and row["params"][0]["period"] > 1
    assert "optimizer   Variant (records gefen/variant/attn.weight): 1 parameters" in render_inspection(report)
    checked = verify_checkpoint(str(step))
    assert checked["ok"], checked["problems"]
    assert checked["variant"] == {"version": schema.VERSION, "optimizers": 1, "params": 1, "codebooks": 1}
    with pytest.raises(CkptError, match="holds Variant state for 1 parameters .*a Variant converts to nothing"):
        convert(str(step), str(tmp_path / "converted"), "adamw")
    assert not (tmp_path / "converted").exists()
    # Without its description its keys are of no known kind: verify fails, inspect warns.
    kinds.unregister("Variant")
    assert "an entry of kind 'variant'" in str(verify_checkpoint(str(step))["problems"])
    assert any("'variant'" in w for w in inspect_checkpoint(str(step))["warnings"])
    kinds.register(registry.get("Variant").checkpoint)

    fresh_model = Net()
    fresh = config.build(model_parts=[fresh_model])
    assert len(_small_reads(_load(fresh, fresh_model, tmp_path, monkeypatch))) == 1
    _same_state(variant, next(o for o in fresh.optimizers if type(o) is Variant))
    _same_state(opt.optimizers_of("Gefen")[0], fresh.optimizers_of("Gefen")[0])

    # The kinds check knows it by its entry: its parameter given to Gefen is refused, naming both.
    moved_model = Net()
    moved = GefenOptimizersContainer.Config(name="Gefen").build(model_parts=[moved_model])
    with pytest.raises(GefenCheckpointError, match=r"\(attn.weight\) were saved by Variant and the recipe gives "
                                                   "them to Gefen"):
        _load(moved, moved_model, tmp_path, monkeypatch)


def test_a_load_agrees_once_per_phase(tmp_path, monkeypatch):
    """Issue 39: one all-ranks verdict per load phase, not one per check: the manager's metadata
    check (before the small read), the optimizer's preparation (the header, the kinds, every kind's
    plan, the records stage: after the small read) and its destinations (every kind's staging: after
    DCP's read). It agreed 8 times with two kinds. A refusal's text rides in its phase's verdict."""
    from gefen_titan.checkpoint import errors

    config, model, opt = _two_kinds_trained()
    _save(opt, model, tmp_path)
    agreed = []
    real = errors.raise_on_any_rank
    monkeypatch.setattr(errors, "raise_on_any_rank", lambda error, what, exc: (agreed.append(what),
                                                                                real(error, what, exc))[1])
    fresh_model = Net()
    _load(config.build(model_parts=[fresh_model]), fresh_model, tmp_path, monkeypatch)
    assert agreed == ["the checkpoint cannot be loaded"] + [f"cannot load optimizer state from {tmp_path}/ckpt/step-1"
                                                            ] * 2
    # A refusal of the preparation phase (the recipe gives GefenMuon's parameters to Gefen): one verdict.
    agreed.clear()
    moved_model = Net()
    with pytest.raises(GefenCheckpointError, match="were saved by GefenMuon and the recipe gives them to Gefen"):
        _load(GefenOptimizersContainer.Config(name="Gefen").build(model_parts=[moved_model]), moved_model, tmp_path,
              monkeypatch)
    assert len(agreed) == 2, agreed
