"""gefen-titan: the Gefen optimizer inside torchtitan, with elastic checkpoints.

Importing the package changes nothing outside it: a trainer that only wants
the optimizer container or the checkpoint manager gets exactly those. The
torchtitan / torch patches that CPU (gloo) training needs
(``gefen_titan.patches``, shipped from the top-level ``patches/`` folder) are
applied by the entry points that train (``gefen_titan.train``) or by an
explicit ``gefen_titan.patches.apply_all()``; the embedded dataset is
registered by the data loader that reads it.
"""

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.recipe import RecipeError, load_recipe

__all__ = ["GefenCheckpointManager", "GefenOptimizersContainer", "RecipeError", "load_recipe"]
__version__ = "0.1.0"
