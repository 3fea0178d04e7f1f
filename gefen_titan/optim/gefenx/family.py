"""The gefen-x family's private state in gefen-x 0.5.0: what every ``gefen.Gefen``, its subclasses
(GefenMuon, a test's kind) included, keeps alike.

Part of ``gefen_titan.optim.gefenx`` (the package doc says why it exists).
Every gefen-x optimizer keeps per parameter ``automatic_period`` in
``optim.state[p]`` and per optimizer ``_gefen_codebook`` (fp32 ``[256]``, with
per-device caches) and ``_gefen_global_step``; its param groups carry the
container's FQNs (``FQNS_KEY``). The accessors here read and set those for
any kind of the family; what one kind keeps of its own is in its module
(Gefen's ``gefen_*`` accessors in ``gefen``, GefenMuon's ``muon_*`` in
``muon``). Also gefen-x's period search scoring, which every kind's agreed
blocking follows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from gefen import Gefen, partitioning
from torch.optim import Optimizer

from gefen_titan.checkpoint.format import schema

__all__ = ["FQNS_KEY", "K", "is_gefenx_optimizer", "named_params", "options", "period", "set_period", "codebook",
           "set_codebook", "global_step", "set_global_step", "advance_global_step", "codebook_tensors",
           "finalize_period", "fallback_enabled"]

K = schema.K  # codebook entries (gefen-x: num_codebooks=256)


def is_gefenx_optimizer(optim: Optimizer) -> bool:
    """A gefen-x optimizer: ``gefen.Gefen`` or any subclass of it (GefenMuon, a variant), all of which
    keep gefen-x's per-optimizer codebook and step counters (``is_gefen`` is Gefen exactly)."""
    return isinstance(optim, Gefen)


# The group key that keeps the container's FQNs: gefen-x replaces a group's
# ``param_names`` with its own lowercased names (torchtitan's MoE weights are
# ``w1_EFD``, ``expert_bias_E``, ...), so the registry's factories put the
# FQNs here too, and gefen-x carries the key along as it carries any other.
FQNS_KEY = "gefen_titan_fqns"


def named_params(optim: Optimizer) -> Iterator[tuple[str, torch.Tensor, dict]]:
    """(canonical name, param, group) in Gefen's param-group order.

    The names are the container's FQNs, as the model names its parameters
    (``FQNS_KEY``; a group built without it, outside the registry: gefen-x's
    ``param_names``, lowercased).
    """
    for group in optim.param_groups:
        for name, p in zip(group.get(FQNS_KEY, group["param_names"]), group["params"], strict=True):
            yield name, p, group


def options(optim: Optimizer) -> dict[str, Any]:
    """The constructor options that change Gefen's arithmetic or layout."""
    return {
        "deterministic": bool(optim._deterministic),
        "factored_v_2d": bool(optim._factored_v_2d),
        "force_1d_period_one": bool(optim._force_1d_period_one),
        "force_2d_period_one": bool(optim._force_2d_period_one),
        "period_one_substrings": tuple(optim._period_one_substrings or ()),
        "codebook_refresh_every": int(optim._codebook_refresh_every or 0),
        "capturable": bool(optim.capturable),
    }


def period(optim: Optimizer, p: torch.Tensor) -> int | None:
    value = optim.state.get(p, {}).get("automatic_period")
    return None if value is None else int(value)


def set_period(optim: Optimizer, p: torch.Tensor, value: int) -> None:
    """Pre-set the block period; Gefen then skips its own search for ``p``."""
    optim.state[p]["automatic_period"] = int(value)


def codebook(optim: Optimizer) -> torch.Tensor | None:
    return optim._gefen_codebook


def set_codebook(optim: Optimizer, value: torch.Tensor | None) -> None:
    """Set the optimizer's codebook; with one set, Gefen learns none."""
    optim._gefen_codebook = value
    # Stale per-device copies would otherwise outlive the change.
    optim._gefen_codebook_by_device.clear()
    optim._gefen_codebook_lut_by_device.clear()


def global_step(optim: Optimizer) -> int:
    return int(optim._gefen_global_step)


def set_global_step(optim: Optimizer, value: int) -> None:
    optim._gefen_global_step = int(value)


def advance_global_step(optim: Optimizer) -> None:
    """The per-optimizer step counter gefen-x's ``step()`` advances last."""
    optim._advance_gefen_global_step()


def codebook_tensors(optim: Optimizer) -> Iterable[torch.Tensor]:
    """The tensors a Gefen-family optimizer keeps outside ``optim.state``: its codebook, once it has one."""
    cb = optim._gefen_codebook
    return (cb,) if isinstance(cb, torch.Tensor) else ()


# ------------------------------------------------------------ period search
def finalize_period(results: list[tuple[int, float]]) -> int:
    """Gefen's own scoring of (period, error) candidates, ascending periods.

    The score of a candidate is the increase of its error over the previous
    candidate's; the smallest score wins (ties: the smaller period); a winner
    below 8 becomes 1 (``gefen.partitioning._finalize_period_results``).
    """
    return int(partitioning._finalize_period_results(results, print_results=False))


def fallback_enabled() -> bool:
    """gefen-x replaces a period-1 result by a coarse block (its memory-safe fallback)."""
    return bool(partitioning.MEMORY_SAFE_FALLBACK)
