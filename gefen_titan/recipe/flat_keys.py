"""Older recipes' spellings of ``[optimizer]`` keys, read into the tables that now hold them.

Lifted per file, before ``extends`` merges a recipe over the one it extends
(``files.read_recipe_tables``): a recipe written in the older spelling that
extends a shipped recipe written in the new one then sets the same place,
and wins as any other key of it does, instead of meeting the parent's table
as a key "set both ways". Overrides (the command line's, a test's) are lifted
after they are merged (``build.build_recipe``): one given in the older
spelling where the recipe sets the table is refused, naming both.
"""

from __future__ import annotations

from typing import Any

from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.recipe.errors import RecipeError

__all__ = ["lift_flat_keys"]


def lift_flat_keys(table: Any, path: str) -> None:
    """Older recipes' flat [optimizer] keys of one table (``muon_bucket_mib``, ``backup_optimizer``,
    ``max_tensor_parallel_degree``, ...) into that table (``Config.flat_keys``), and a plain value where
    a table now is (``blocking = "per_rank"``) into the field it stood for (``Config.scalar_fields``:
    ``[optimizer.blocking] mode``), in place. A key set both ways is refused: neither could say which
    one was meant."""
    if not isinstance(table, dict):
        return
    config = GefenOptimizersContainer.config_class()
    for name, field_ in config.scalar_fields().items():
        if name in table and not isinstance(table[name], dict):
            table[name] = {field_: table[name]}
    for old, places in config.flat_keys().items():
        if old not in table:
            continue
        value = table.pop(old)
        for place in places:
            kind, _, key = place.partition(".")
            nested = table.setdefault(kind, {})
            if isinstance(nested, dict) and key in nested:
                raise RecipeError(
                    f"{path}: [optimizer] {old} and [optimizer.{kind}] {key} are both set: {old} is the older "
                    f"spelling of {place}; keep only [optimizer.{kind}] {key}")
            if isinstance(nested, dict):
                nested[key] = value
