"""Gefen as torchtitan optimizers: the container, and what Gefen's state is.

* ``container``: ``GefenOptimizersContainer``, torchtitan's optimizer
  component with Gefen registered beside AdamW/Adam, and its ``Config``;
* ``gefenx``: the one module that reads or writes gefen-x's private
  optimizer state;
* ``blocking``: agreed blocking, the first-step agreement that makes the
  state a function of the model (periods and one codebook for the job);
  ``block_periods``: the periods a parameter may have and the one Gefen's
  scoring picks (shapes and placements only, no communication);
* ``codebook_solver``: gefen-x's exact codebook DP, fast;
* ``hybrid``: ``name = "GefenMuonHybrid"``, GefenMuon and Gefen/AdamW
  param groups routed by module (a registry ``CompositeSpec``), and its
  options table ``[optimizer.hybrid]``;
* ``registry``: what gefen-titan knows about each optimizer a recipe can name
  (the mechanism); ``kinds``: the built-in kinds, a folder each (entry,
  options table, state adapters), and ``register_builtins()``;
* ``checkpointing``: the state adapters' mechanism (how a kind's state becomes
  checkpoint entries and back, and the load's records read).
"""

from gefen_titan.optim.container import GefenOptimizersContainer

__all__ = ["GefenOptimizersContainer"]
