"""gefen-x's constructor options from any route: each is applied at its one place, routed there, or refused.

Every keyword of gefen-x's ``Gefen.__init__`` and ``GefenMuon.__init__`` is
classified once (``gefenx.GEFEN_CONSTRUCTOR``, ``gefenx.MUON_CONSTRUCTOR``),
and ``optim.option_routes`` applies the classification to the three routes
(the kind's table, ``optimizer_factory_kwargs_by_name``, a param group's
``optimizer_kwargs``). Each option's outcome is checked through the recipe
layer and through the container's Config; the classification is checked
against the installed gefen-x's signatures, so a keyword a new gefen-x
grows fails here until it is classified.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import gefen
import pytest
import torch.nn as nn

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import param_groups, registry
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.kinds.gefen.options import GefenOptions
from gefen_titan.optim.kinds.gefen_muon.options import MuonOptions
from gefen_titan.recipe import RecipeError, load_recipe
from gefen_titan.recipe.cli import load_cli

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"Gefen": str(ROOT / "recipes" / "llama_gefen.toml"),
           "GefenMuon": str(ROOT / "recipes" / "llama_gefen_muon.toml")}
GEFEN_X = {"Gefen": gefen.Gefen, "GefenMuon": gefen.GefenMuon}
Config = GefenOptimizersContainer.Config

# Every (kind, keyword, outcome) of the classification. The value given never matters to the rule (it is
# refused or routed whatever it is), so every case gives the same one.
CASES = [(kind, key, outcome) for kind in GEFEN_X for key, outcome in registry.get(kind).constructor.options.items()]
IDS = [f"{kind}.{key}" for kind, key, _ in CASES]
VALUE = 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 32, bias=False)
        self.w2 = nn.Linear(32, 16, bias=False)
        self.norm = nn.LayerNorm(16)


def _config(kind: str, **kw) -> GefenOptimizersContainer.Config:
    """A Config whose groups use ``kind`` (GefenMuon for the matrices, Gefen for the rest)."""
    groups = [ParamGroup(pattern=r"^w[12]\.weight$", optimizer_name="GefenMuon"), ParamGroup(pattern=".*")]
    return Config(name="Gefen", param_groups=groups if kind == "GefenMuon" else [], **kw)


def _expected(kind: str, key: str, outcome, route: str) -> str:
    """The text the refusal of ``key`` by ``route`` must hold (its place, or its reason)."""
    spec = registry.get(kind)
    if isinstance(outcome, gx.Refused):
        return f"gefen-x's {kind} option {key!r} is refused: {outcome.reason}. Remove it"
    if isinstance(outcome, gx.Routed):
        return f"gefen-x's {kind} option {key!r} is set at {outcome.place}: set it there instead"
    assert route != "table"
    return f"set optimizer.{spec.options}.{outcome.field} instead"


# ------------------------------------------------------------------ the classification
@pytest.mark.parametrize("kind", GEFEN_X)
def test_every_keyword_of_gefen_xs_constructor_is_classified_once(kind):
    constructor = registry.get(kind).constructor
    assert constructor.cls is GEFEN_X[kind]
    keywords = [k for k in inspect.signature(GEFEN_X[kind].__init__).parameters if k not in ("self", "params")]
    assert sorted(keywords) == sorted(constructor.options), "a gefen-x keyword is unclassified, or an entry is stale"
    assert constructor.unclassified() == []
    assert all(isinstance(o, (gx.Applied, gx.Routed, gx.Refused)) for o in constructor.options.values())


@pytest.mark.parametrize("kind", GEFEN_X)
def test_a_keyword_a_new_gefen_x_grows_is_caught(kind, monkeypatch):
    cls = GEFEN_X[kind]
    sig = inspect.signature(cls.__init__)
    grown = sig.replace(parameters=[*sig.parameters.values(),
                                    inspect.Parameter("new_knob", inspect.Parameter.KEYWORD_ONLY, default=False)])
    monkeypatch.setattr(cls.__init__, "__signature__", grown, raising=False)
    assert registry.get(kind).constructor.unclassified() == ["new_knob"]
    # Until it is classified, no route lets it through to gefen-x.
    with pytest.raises(ValueError, match=f"'new_knob' is no option of gefen-x's {kind}"):
        param_groups.check_param_groups(_config(kind, optimizer_factory_kwargs_by_name={kind: {"new_knob": True}}))


def test_applied_options_are_fields_of_the_kinds_table():
    tables = {"gefen": GefenOptions, "muon": MuonOptions}
    for kind, key, outcome in CASES:
        if isinstance(outcome, gx.Applied):
            spec = registry.get(kind)
            assert outcome.field in spec.option_keys, (kind, key)
            assert outcome.field in {f.name for f in dataclasses.fields(tables[spec.options])}, (kind, key)


def test_the_muon_refusals_are_the_classifications():
    refused = {k: o.reason for k, o in gx.MUON_CONSTRUCTOR.options.items() if isinstance(o, gx.Refused)}
    assert gx.MUON_REFUSED == refused


# ------------------------------------------------------------------ optimizer_factory_kwargs_by_name
@pytest.mark.parametrize("kind, key, outcome", CASES, ids=IDS)
def test_factory_kwargs_are_refused_naming_the_place_or_the_reason_in_the_config(kind, key, outcome):
    config = _config(kind, optimizer_factory_kwargs_by_name={kind: {key: VALUE}})
    want = f"optimizer_factory_kwargs_by_name.{kind}.{key}: "
    with pytest.raises(ValueError) as info:
        param_groups.check_param_groups(config)
    assert str(info.value).startswith(want) and _expected(kind, key, outcome, "factory") in str(info.value)
    # Building the container without the checks says the same, before gefen-x's TypeError could.
    with pytest.raises(ValueError) as info:
        config.build(model_parts=[Net()])
    assert str(info.value).startswith(want) and _expected(kind, key, outcome, "factory") in str(info.value)


@pytest.mark.parametrize("kind, key, outcome", CASES, ids=IDS)
def test_factory_kwargs_are_refused_naming_the_place_or_the_reason_in_a_recipe(kind, key, outcome):
    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES[kind], {"optimizer": {"optimizer_factory_kwargs_by_name": {kind: {key: VALUE}}}},
                    world_size=2)
    text = str(info.value)
    assert text.startswith(f"{RECIPES[kind]}: [optimizer] optimizer_factory_kwargs_by_name.{kind}.{key}: ")
    assert _expected(kind, key, outcome, "factory") in text


@pytest.mark.parametrize("kind, table, key", [("Gefen", "gefen", "cpu_step"), ("GefenMuon", "muon", "bucket_mib"),
                                              ("GefenMuon", "muon", "cpu_step")])
def test_gefen_titans_own_options_as_factory_kwargs_go_to_the_table(kind, table, key):
    with pytest.raises(ValueError, match=f"'{key}', gefen-titan's {kind} option, applies to every {kind} "
                                         f"optimizer of the run: set optimizer.{table}.{key} instead"):
        param_groups.check_param_groups(_config(kind, optimizer_factory_kwargs_by_name={kind: {key: VALUE}}))


def test_the_hybrids_factory_kwargs_name_each_place():
    config = Config(name="GefenMuonHybrid", optimizer_factory_kwargs_by_name={
        "GefenMuonHybrid": {"momentum": 0.9, "fp8_ns": True, "lr": 1e-3}})
    with pytest.raises(ValueError) as info:
        param_groups.check_param_groups(config)
    text = str(info.value)
    assert text.startswith("optimizer_factory_kwargs_by_name.GefenMuonHybrid: GefenMuonHybrid is no optimizer")
    assert "momentum: set optimizer.hybrid.momentum instead" in text
    assert f"fp8_ns: gefen-x's GefenMuonHybrid option is not supported: {gx.MUON_REFUSED['fp8_ns']}" in text
    assert "lr: set [optimizer] lr instead" in text


# ------------------------------------------------------------------ the kind's table
@pytest.mark.parametrize("kind, key, outcome", [c for c in CASES if not isinstance(c[2], gx.Applied)],
                         ids=[i for i, c in zip(IDS, CASES) if not isinstance(c[2], gx.Applied)])
def test_a_tables_key_whose_place_is_elsewhere_or_refused_says_so(kind, key, outcome):
    table = registry.get(kind).options
    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES[kind], {"optimizer": {table: {key: VALUE}}}, world_size=2)
    assert str(info.value).startswith(f"{RECIPES[kind]}: [optimizer] {table}.{key}: ")
    assert _expected(kind, key, outcome, "table") in str(info.value)
    # The command line's flag says the same.
    flag = f"--optimizer.{table}.{key.replace('_', '-')}"
    with pytest.raises(RecipeError) as info:
        load_cli(["--job.config", RECIPES[kind], flag, "1"], world_size=2)
    assert str(info.value).startswith(f"command line: {flag}: ")
    assert _expected(kind, key, outcome, "table") in str(info.value)


# field -> (a value other than the default, the [optimizer.blocking] keys it needs)
APPLIED = {"force_1d_period_one": (False, {"mode": "per_rank"}), "period_one_substrings": (["norm"], {}),
           "codebook_refresh_every": (3, {"mode": "per_rank"}), "deterministic": (True, {})}


def _built_option(optim, kind: str, key: str):
    return gx.options(optim)[key] if kind == "Gefen" else gx.muon_deterministic(optim)


@pytest.mark.parametrize("kind, key, outcome", [c for c in CASES if isinstance(c[2], gx.Applied)],
                         ids=[i for i, c in zip(IDS, CASES) if isinstance(c[2], gx.Applied)])
def test_a_tables_applied_option_reaches_every_optimizer_of_its_kind(kind, key, outcome):
    value, needs = APPLIED[outcome.field]
    table = registry.get(kind).options
    recipe = load_recipe(RECIPES[kind], {"optimizer": {table: {outcome.field: value}, "blocking": needs}},
                         world_size=2)
    assert getattr(getattr(recipe.config.optimizer, table), outcome.field) == value
    options = {"gefen": GefenOptions, "muon": MuonOptions}[table](**{outcome.field: value})
    if kind == "GefenMuon":
        needs = {}  # GefenMuon needs agreed blocking
    opt = _config(kind, **{table: options}, blocking=BlockingOptions(**needs)).build(model_parts=[Net()])
    (optim, *_) = opt.optimizers_of(kind)
    built = _built_option(optim, kind, key)
    assert (list(built) if isinstance(built, tuple) else built) == value


# ------------------------------------------------------------------ a param group's optimizer_kwargs
@pytest.mark.parametrize("kind, key, outcome", CASES, ids=IDS)
def test_a_group_key_is_read_or_refused_naming_the_place_or_the_reason(kind, key, outcome):
    spec = registry.get(kind)
    groups = [ParamGroup(pattern=r"^w[12]\.weight$" if kind == "GefenMuon" else ".*", optimizer_name=kind,
                         optimizer_kwargs={key: VALUE}), ParamGroup(pattern=".*")]
    config = Config(name="Gefen", param_groups=groups)
    if isinstance(outcome, gx.Routed) and key in spec.group_keys:
        param_groups.check_param_groups(config)  # a group key the optimizer reads
        return
    with pytest.raises(ValueError) as info:
        param_groups.check_param_groups(config)
    assert str(info.value).startswith("param_groups[0] optimizer_kwargs: ")
    assert _expected(kind, key, outcome, "group") in str(info.value)


def test_factored_v_2d_as_a_group_key_is_not_sent_to_a_table_that_refuses_it():
    groups = [ParamGroup(pattern=".*", optimizer_kwargs={"factored_v_2d": True})]
    with pytest.raises(ValueError) as info:
        param_groups.check_param_groups(Config(name="Gefen", param_groups=groups))
    # It points to gefen-titan's own switch, not to a table key that does not exist.
    assert "optimizer.gefen.second_moment = \"factored\"" in str(info.value)
    assert "set optimizer.gefen.factored_v_2d" not in str(info.value)


# ------------------------------------------------------------------ docs
def test_the_recipes_doc_names_every_option_with_its_outcome():
    """docs/recipes.md's table: a row per keyword, a column per kind (what the code does with it there)."""
    doc = (ROOT / "docs" / "recipes.md").read_text()
    section = doc[doc.index("## gefen-x's options"):]
    section = section[:section.index("\n## ")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.update({key.strip("`"): dict(zip(GEFEN_X, cells[1:])) for key in cells[0].split(", ")})
    keys = {key for _, key, _ in CASES}
    assert set(rows) == keys
    for key in keys:
        for kind in GEFEN_X:
            outcome = registry.get(kind).constructor.options.get(key)
            cell = rows[key][kind]
            if outcome is None:
                assert cell == "-", (kind, key)
            elif isinstance(outcome, gx.Applied):
                assert cell.startswith("applied") and f"optimizer.{registry.get(kind).options}.{outcome.field}" in cell
            else:
                assert cell.startswith("refused" if isinstance(outcome, gx.Refused) else "routed"), (kind, key)
