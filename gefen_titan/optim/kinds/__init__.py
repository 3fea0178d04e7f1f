"""The built-in optimizer kinds, one folder each, and the one call that registers them.

``registry`` is the mechanism (``OptimizerSpec``, ``register``, lookups); what
gefen-titan knows about each built-in kind is here:

* ``gefen/``: Gefen (``entry``: its registry entry and factory; ``options``:
  ``[optimizer.gefen]``; ``keys``: its rows of the checkpoint format;
  ``records`` and ``records_v1``: its records; ``description``: its
  checkpoint description, read by the load's records stage and the offline
  tools; ``cost``: what its state costs; ``sharded`` and ``per_rank``: its
  state adapters, formats v3/v2 and v1, with ``per_rank_plan`` and
  ``per_rank_regions``; ``validation``: its part of the reshard validation);
* ``gefen_muon/``: GefenMuon (``entry``, ``options``: ``[optimizer.muon]``,
  ``keys``, ``records``, ``description``, ``cost``, ``sharded``); its
  sharded step is ``optim.muon``;
* ``torch_optimizers``: torch's AdamW and Adam;
* ``groups``: what both gefen-x factories do to torchtitan's param groups.

A kind's checkpoint knowledge reaches the layer below (``gefen_titan.checkpoint``,
which names no kind) only through its description, which its registry entry
carries: registering the entry registers the description and its key rows.

``register_builtins()`` registers them (and ``GefenMuonHybrid``, a composite
name: ``optim.hybrid``) in one fixed order, the same on every rank (the
registry's order is the agreement's codebook order). The container's module
calls it where it is imported, because its Config types ``name`` with the
registered names and tyro needs them then (``gefen_titan.optim`` imports the
container, so any use of the package has them); the offline tools call it
again at each entry point, and a second call does nothing. No module of a
kind registers itself when imported.
"""

from __future__ import annotations

from gefen_titan.optim import hybrid, registry
from gefen_titan.optim.kinds import torch_optimizers
from gefen_titan.optim.kinds.gefen import entry as gefen_entry
from gefen_titan.optim.kinds.gefen_muon import entry as gefen_muon_entry

__all__ = ["register_builtins"]

_registered = False


def register_builtins() -> None:
    """Register Gefen, AdamW, Adam, GefenMuon and GefenMuonHybrid, once per process."""
    global _registered
    if _registered:
        return
    _registered = True
    for spec in (gefen_entry.spec(), *torch_optimizers.specs(), gefen_muon_entry.spec()):
        registry.register(spec)
    registry.register_composite(registry.CompositeSpec(
        name=hybrid.NAME,
        param_groups=hybrid.param_groups,
        bind=hybrid.bind,
        check=hybrid.check,
        option_keys=hybrid.OPTION_KEYS,
        refused_keys=hybrid.REFUSED,
        kind_hint=hybrid.kind_hint,
        options="hybrid",
        options_type=hybrid.HybridOptions,
    ))
