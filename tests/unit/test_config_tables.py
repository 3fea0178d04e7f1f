"""The container Config's options tables come from the registry (``optim.config_tables``): a kind registered
after the Config was defined has its ``[optimizer.<table>]`` read through ``config_class()``, and it reaches
the kind's factory. Removing the generation fails here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from gefen_titan.optim import registry
from gefen_titan.optim.container import GefenOptimizersContainer, ParamGroup
from gefen_titan.optim.options_table import OptionsTableBase
from gefen_titan.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
NAME, TABLE = "ToyAdamW", "toy"


@dataclass(kw_only=True, slots=True)
class ToyOptions(OptionsTableBase):
    """``[optimizer.toy]``: the test kind's options."""

    scale: float = 1.0
    """A constructor option every ToyAdamW is built with."""

    def kwargs(self, config: Any = None) -> dict[str, Any]:
        return {"scale": self.scale}


class ToyAdamW(torch.optim.AdamW):
    pass


def _toy_factory(seen: list[float]):
    def build(param_groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
        seen.extend(g.pop("scale") for g in param_groups)  # the container fills it into every group
        return ToyAdamW(param_groups, **kwargs)
    return build


@pytest.fixture
def toy_kind():
    seen: list[float] = []
    registry.register(registry.OptimizerSpec(
        name=NAME, factory=_toy_factory(seen), owns=lambda o: type(o) is ToyAdamW,
        group_keys=("lr", "betas", "eps", "weight_decay"), option_keys=("scale",), options=TABLE,
        options_type=ToyOptions))
    try:
        yield seen
    finally:
        registry.unregister(NAME)


def test_the_built_in_tables_are_static_fields_of_the_config():
    fields = {f.name: f for f in dataclasses.fields(GefenOptimizersContainer.Config)}
    for table, options_type in registry.option_tables().items():
        assert fields[table].default_factory is options_type
    assert GefenOptimizersContainer.config_class() is GefenOptimizersContainer.Config


def test_a_kind_registered_later_has_its_table_read_and_given_to_its_factory(toy_kind):
    config_class = GefenOptimizersContainer.config_class()
    assert config_class is not GefenOptimizersContainer.Config
    assert config_class is GefenOptimizersContainer.config_class()  # one per set of tables
    assert issubclass(config_class, GefenOptimizersContainer.Config) and TABLE in config_class.__dataclass_fields__
    recipe = load_recipe(ROOT / "recipes" / "llama_gefen.toml", {"optimizer": {
        TABLE: {"scale": 3.0},
        "param_groups": [{"pattern": r"^0\.", "optimizer_name": NAME}, {"pattern": ".*"}]}}, world_size=2)
    opt_config = recipe.config.optimizer
    assert type(opt_config) is config_class and opt_config.toy == ToyOptions(scale=3.0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    container = opt_config.build(model_parts=[model])
    assert toy_kind == [3.0] and len(container.optimizers_of(NAME)) == 1


def test_a_config_without_a_kinds_table_is_one_clear_error(toy_kind):
    config = GefenOptimizersContainer.Config(param_groups=[ParamGroup(pattern=".*", optimizer_name=NAME)])
    with pytest.raises(ValueError, match=r"optimizer.toy: .* build the config with "
                                         r"GefenOptimizersContainer.config_class\(\)"):
        config.build(model_parts=[nn.Linear(4, 4)])


def test_an_unknown_table_key_of_a_later_kind_is_refused(toy_kind):
    from gefen_titan.recipe import RecipeError

    with pytest.raises(RecipeError, match="toy"):
        load_recipe(ROOT / "recipes" / "llama_gefen.toml", {"optimizer": {TABLE: {"scael": 3.0}}}, world_size=2)
