"""What an optimizer kind lends the reshard validation (``gefen_titan.validation``): its entry's ``validation``.

The validation dumps the state around a save and a load, and compares them
(``docs/validation.md``). What is generic (parameters, every checkpoint
entry bit for bit, the flat state of torch's optimizers) it does itself; what
only a kind knows it asks the kind through this face, found on the kind's
registry entry (``optim.registry.OptimizerSpec.validation``), so the
validation names no kind and a new kind adds its own module, not an edit of
``validation/``:

* its **live facts** on a rank (agreed blocking): plain data the dump gathers
  from every rank (periods, counters, hyperparameters, codebooks as the
  optimizer holds them), and the problems of a resumed run's facts against
  the saved run's;
* its **dense state** from the gathered checkpoint entries (agreed blocking):
  per parameter the per-element momentum ``m``, second moment ``v`` and the
  first update ``u`` of a zero gradient, which the validation turns into the
  report's relative L2 figures (``momentum_rel_l2``, ``vmean_rel_l2``,
  ``first_update_rel_l2``: 0 when the state is exact);
* for a kind that runs under per-rank blocking (format v1, where a load
  requantizes): each rank's own picture of its state, the comparison of the
  resumed ranks' pictures against the saved ones (figures, problems, whether
  exact), and the bounds of those figures.

A kind without an entry here is compared as checkpoint entries only (bit
for bit under agreed blocking), which is what every kind's format promises.
This module names no kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["DENSE_FIGURES", "KindValidation", "rel_l2"]

# The dense state's parts -> the report's figure of each (relative L2 over the kinds' parameters).
DENSE_FIGURES = {"m": "momentum_rel_l2", "v": "vmean_rel_l2", "u": "first_update_rel_l2"}


@dataclass(frozen=True)
class KindValidation:
    """One kind's part of the reshard validation (every callable is pure but ``live_facts`` / ``rank_state``,
    which read the live optimizers and change nothing; none makes a collective)."""

    live_facts: Callable[[list[Optimizer]], Any]
    """This rank's live facts of the kind's optimizers: plain data and CPU tensors (agreed dumps)."""
    live_problems: Callable[[list[Any], list[Any]], list[str]]
    """(saved run's facts per rank, resumed run's per rank; None where a rank has none) -> the problems."""
    dense: Callable[[dict[str, Any]], dict[str, dict[str, torch.Tensor]]] | None = None
    """Gathered checkpoint entries -> per parameter with state, flat float tensors ``m``, ``v``, ``u``
    (``DENSE_FIGURES``); a parameter whose entries are missing is left out."""
    rank_state: Callable[[list[Optimizer]], Any] | None = None
    """Per-rank blocking: this rank's own picture of the kind's state (plain data, CPU tensors)."""
    compare_rank: Callable[[list[Any], list[Any]], dict[str, Any]] | None = None
    """Per-rank blocking: (saved ranks' pictures, resumed ranks') -> its figures (the ``DENSE_FIGURES``
    values among them), ``problems`` (list) and ``exact`` (bool)."""
    rank_tolerances: dict[str, float] = field(default_factory=dict)
    """Per-rank blocking: the bound of each of its figures that has one."""


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|; where b is 0, 1 if a differs and 0 if not."""
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm() > 0)
