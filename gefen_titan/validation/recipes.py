"""The recipe as the reshard validation reads it: where it is, its tables, its imports, its config.

Every read of the recipe layer (``gefen_titan.recipe``) by the validation goes
through here, so a change of that layer's names touches one module.

Recipe paths are resolved against the current directory only: the
validation runs from an installed wheel as well as from a checkout, so it
knows no folder of its own to look in (``scripts/validate_reshard.py``, a
command line of the checkout, adds the checkout's ``recipes/`` itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gefen_titan.recipe.build import build_recipe, load_recipe
from gefen_titan.recipe.cli import load_cli, parse_cli, parse_flags
from gefen_titan.recipe.files import declared_world_size, merge_tables, read_recipe_tables
from gefen_titan.recipe.flat_keys import lift_flat_keys

__all__ = ["checked_config", "config_of", "merged_tables", "recipe_imports", "recipe_tables", "recipe_world_size",
           "resolve_recipe"]


def resolve_recipe(recipe: str) -> str:
    """The recipe's absolute path, resolved against the current directory.

    Raises FileNotFoundError naming the path given and the path tried.
    """
    path = Path(recipe).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"recipe {recipe!r} not found (looked for {path}, relative to the current "
                                f"directory {Path.cwd()})")
    return str(path)


def recipe_tables(recipe: str) -> dict[str, Any]:
    """The recipe's TOML tables with ``extends`` resolved."""
    return read_recipe_tables(resolve_recipe(recipe))


def recipe_world_size(recipe: str) -> int:
    """The number of processes the recipe's own mesh declares."""
    return declared_world_size(resolve_recipe(recipe))


def merged_tables(recipe: str, overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The recipe's tables (``extends`` resolved) with the recipe flags of
    ``overrides`` merged in, and the other (torchtitan) flags as given."""
    recipe = resolve_recipe(recipe)
    data = read_recipe_tables(recipe)
    cl = parse_cli(["--job.config", recipe, *overrides])
    merge_tables(data, cl.overrides, recipe)
    lift_flat_keys(data.get("optimizer"), recipe)  # an older recipe's flat keys: the same run as the tables'
    return data, cl.args


def config_of(recipe: str, overrides: list[str]) -> Any:
    """The ``Trainer.Config`` a run of the recipe with these flags builds,
    without the mesh check (it is asked once for every size)."""
    cl = parse_cli(["--job.config", resolve_recipe(recipe), *overrides])
    return parse_flags(build_recipe(cl.path, cl.overrides).config, cl.args)


def checked_config(recipe: str, overrides: list[str], world_size: int) -> Any:
    """The config a run of the recipe with these flags at ``world_size``
    processes builds, with every check ``train.py`` makes before a process
    group exists (mesh, global batch, optimizer keys): ``RecipeError`` names
    what no run can take."""
    return load_cli(["--job.config", resolve_recipe(recipe), *overrides], world_size=world_size).config


def recipe_imports(recipe: str) -> list[Any]:
    """The recipe's own ``[override] imports``, as JSON-able entries (a target, or [target, kwargs])."""
    # Only [override] is read: any world size the recipe's own mesh accepts.
    path = resolve_recipe(recipe)
    imports = load_recipe(path, world_size=declared_world_size(path)).config.override.imports
    return [e if isinstance(e, str) else [e[0], dict(e[1])] for e in imports]
