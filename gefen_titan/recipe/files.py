"""Recipe files as tables: TOML, ``[job] extends``, and overrides merged in.

What a recipe file says before anything is checked against torchtitan's
config: its tables (section -> key -> value) on top of those of the recipe
it ``extends``, with override tables (the command line's recipe flags, a
test's overrides) merged over them. ``declared_world_size`` reads the mesh
from the tables alone, so a launcher knows how many processes to start
without building a config.
"""

from __future__ import annotations

import os
import tomllib
from typing import Any

from gefen_titan.recipe.errors import RecipeError
from gefen_titan.recipe.flat_keys import lift_flat_keys

__all__ = ["declared_world_size", "merge_tables", "read_recipe_tables"]


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found{_recipes_beside(path)}") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from None


def _recipes_beside(path: str) -> str:
    """The recipes that do exist where ``path`` points (its folder), for the not-found message."""
    folder = os.path.dirname(path) or "."
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".toml"))
    except OSError:
        return f" (nor is its folder {folder})"
    if not names:
        return f" (no .toml recipe in {folder})"
    return f"; the recipes in {folder}: {', '.join(names)}"


def read_recipe_tables(path: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The recipe's tables, on top of those of the recipe it ``extends``.

    ``[job] extends = "llama_gefen.toml"`` (relative to this file) lets a
    variant state only what differs, e.g. its mesh.
    """
    data = _read_toml(path)
    lift_flat_keys(data.get("optimizer"), path)  # this file's older spellings, before a merge (flat_keys)
    job = data.get("job", {})
    parent = job.get("extends") if isinstance(job, dict) else None
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise RecipeError(f"{path}: [job] extends: expected a path string, got {parent!r}")
    parent_path = os.path.normpath(os.path.join(os.path.dirname(path), parent))
    if os.path.abspath(parent_path) in _seen + (os.path.abspath(path),):
        raise RecipeError(f"{path}: [job] extends: {parent!r} extends itself (cycle)")
    if not os.path.exists(parent_path):
        raise RecipeError(f"{path}: [job] extends: {parent_path} not found")
    base = read_recipe_tables(parent_path, _seen + (os.path.abspath(path),))
    base.get("job", {}).pop("extends", None)
    job.pop("extends")
    merge_tables(base, data, path)
    return base


def merge_tables(data: dict[str, Any], overrides: dict[str, Any], path: str, where: str = "") -> None:
    """Merge ``overrides`` into ``data`` in place, table by table (a value
    replaces a value; a table over a value is an error naming ``path``)."""
    for key, value in overrides.items():
        if isinstance(value, dict):
            sub = data.setdefault(key, {})
            if not isinstance(sub, dict):
                raise RecipeError(f"{path}: {where}{key} is a value, not a section")
            merge_tables(sub, value, path, f"{where}{key}.")
        else:
            data[key] = value


def declared_world_size(path: str | os.PathLike, fill: int = 2) -> int:
    """Processes a recipe's mesh needs: the product of its declared degrees.

    ``data_parallel_shard_degree = -1`` (FSDP over whatever is left) counts as
    ``fill``; the other degrees default to 1.
    """
    par = read_recipe_tables(str(path)).get("parallelism", {})
    shard = int(par.get("data_parallel_shard_degree", -1))
    world = fill if shard < 0 else shard
    for key in ("data_parallel_replicate_degree", "context_parallel_degree", "tensor_parallel_degree",
                "pipeline_parallel_degree", "expert_parallel_degree"):
        if key != "expert_parallel_degree":  # EP borrows from the others, adds no ranks
            world *= max(1, int(par.get(key, 1)))
    return world
