"""TOML recipes over torchtitan's Python configs, and the command line over them."""

from gefen_titan.recipe.build import (
    Recipe,
    RecipeError,
    build_recipe,
    declared_world_size,
    finish_recipe,
    load_recipe,
    validate_mesh,
)

__all__ = ["Recipe", "RecipeError", "build_recipe", "declared_world_size", "finish_recipe", "load_recipe",
           "validate_mesh"]
