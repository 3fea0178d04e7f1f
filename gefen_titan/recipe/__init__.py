"""TOML recipes over torchtitan's Python configs, and the command line over them.

``build`` turns a recipe into torchtitan's ``Trainer.Config`` (on ``files``,
which reads the TOML, and ``coerce``, which checks tables into dataclasses);
``checks`` refuses what no run can use; ``cli`` parses torchtitan's command
line over the recipe; ``flavors`` adds Llama 3 flavors to torchtitan, ``moe_flavors``
small DeepSeek-V3 and Qwen3 mixture-of-experts ones (``build.EXTRA_FLAVORS``).
"""

from gefen_titan.recipe.build import Recipe, build_recipe, finish_recipe, load_recipe
from gefen_titan.recipe.checks import validate_mesh
from gefen_titan.recipe.errors import RecipeError
from gefen_titan.recipe.files import declared_world_size

__all__ = ["Recipe", "RecipeError", "build_recipe", "declared_world_size", "finish_recipe", "load_recipe",
           "validate_mesh"]
