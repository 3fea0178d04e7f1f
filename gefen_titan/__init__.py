"""gefen-titan: the Gefen optimizer inside torchtitan, with elastic checkpoints.

Importing the package applies our torchtitan patches (``gefen_titan.patches``,
shipped from the top-level ``patches/`` folder) once, in this one place, and
registers the embedded default dataset and the extra model flavors
(``flavors.py``). All are idempotent; the patches refuse
to run against a torchtitan or torch they were not written for.
"""

from .patches import apply_all as _apply_patches

_apply_patches()

from .data import register_datasets as _register_datasets  # noqa: E402

_register_datasets()

from .flavors import register_flavors as _register_flavors  # noqa: E402

_register_flavors()

from .optimizer import GefenOptimizersContainer  # noqa: E402
from .recipe import load_recipe, RecipeError  # noqa: E402

__all__ = ["GefenOptimizersContainer", "load_recipe", "RecipeError"]
__version__ = "0.1.0"
