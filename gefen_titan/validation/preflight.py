"""Every side of every pair checked before any run: a bad pair fails in seconds, naming itself.

A validation trains references for minutes before its first resume; a
side that cannot run (degrees that do not divide its processes, a global
batch its data-parallel size cannot split, EP on a model without experts,
a TP degree the checkpoints were not blocked for) would otherwise fail
there, or worse, halfway through the pairs. ``check_pairs`` builds each
side's config as ``train.py`` would (``recipes.checked_config``: the recipe
layer's own checks at that world size) and asks ``layouts.config_problems``
what the model cannot take; the message names the pair, the side and the
setting.
"""

from __future__ import annotations

from gefen_titan.recipe.errors import RecipeError
from gefen_titan.validation.layouts import LayoutError, Side, config_problems
from gefen_titan.validation.recipes import checked_config
from gefen_titan.validation.runs import Settings

__all__ = ["check_pairs"]


def _side_problems(settings: Settings, side: Side) -> tuple[list[str], dict[str, int], object | None]:
    try:
        degrees = settings.degrees(side)
    except LayoutError as e:
        return [str(e).partition(": ")[2] or str(e)], {}, None
    try:
        config = checked_config(settings.recipe, settings.overrides(side), side.nproc)
    except (RecipeError, ValueError) as e:
        return [str(e)], degrees, None
    return config_problems(config, degrees), degrees, config


def _tp_problem(source: dict[str, int], target: dict[str, int], config: object) -> str | None:
    """Agreed blocking cuts blocks that no last-dim cut of the source's TP
    degree or of a TP degree dividing ``optimizer.blocking.max_tensor_parallel_degree``
    crosses; a resume at another TP degree is refused at the load unless the
    periods happen to fit (``optim.block_periods.check_period_fits``)."""
    opt = config.optimizer
    tp, declared = target["tp"], int(opt.blocking.max_tensor_parallel_degree)
    if opt.blocking.mode != "agreed" or tp == 1 or tp == source["tp"] or declared % tp == 0:
        return None
    return (f"tp {tp}: the source's checkpoint is blocked for TP degrees dividing "
            f"optimizer.blocking.max_tensor_parallel_degree = {declared} (and its own TP {source['tp']}); set it "
            f"to a multiple of {tp} (--set optimizer.blocking.max_tensor_parallel_degree={tp}) or resume at one "
            "of those")


def check_pairs(settings: Settings, pairs: list[tuple[Side, Side]]) -> None:
    """Raise LayoutError naming the pair, the side and the problem, for the
    first side (in pair order) that no run can take."""
    checked: dict[Side, tuple[list[str], dict[str, int], object | None]] = {}
    for a, b in pairs:
        for which, side in (("source", a), ("target", b)):
            if side not in checked:
                checked[side] = _side_problems(settings, side)
            problems = checked[side][0]
            if problems:
                raise LayoutError(f"pair {a.label}:{b.label}, {which} side {side.label} ({side.nproc} processes): "
                                  + "; ".join(problems))
        config = checked[b][2]
        if config is not None and (why := _tp_problem(checked[a][1], checked[b][1], config)):
            raise LayoutError(f"pair {a.label}:{b.label}, target side {b.label}: {why}")
