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
from gefen_titan.optim import registry
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.gefen_options import GefenOptions
from gefen_titan.optim.muon.options import MuonOptions

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
