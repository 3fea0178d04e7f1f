"""The one error of the recipe layer.

Every problem with a recipe, an override or a command-line flag is a
``RecipeError`` whose message names the file (or "command line") and the key,
raised before any process group exists, so all ranks fail the same way.
"""

from __future__ import annotations

from gefen_titan.errors import UserError

__all__ = ["RecipeError"]


class RecipeError(UserError, ValueError):
    """A recipe (or an override of it) that cannot describe a valid run."""
