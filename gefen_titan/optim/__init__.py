"""Gefen as torchtitan optimizers: the container, and what Gefen's state is.

* ``container``: ``GefenOptimizersContainer``, torchtitan's optimizer
  component with Gefen registered beside AdamW/Adam, and its ``Config``;
* ``gefenx``: the one module that reads or writes gefen-x's private
  optimizer state;
* ``blocking``: agreed blocking, the first-step agreement that makes the
  state a function of the model (periods and one codebook for the job);
* ``codebook_solver``: gefen-x's exact codebook DP, fast;
* ``hybrid``: ``name = "GefenMuonHybrid"``, GefenMuon and Gefen/AdamW
  param groups routed by module (a registry ``CompositeSpec``), and its
  options table ``[optimizer.hybrid]``;
* ``gefen_options``: ``[optimizer.gefen]``, Gefen's own options (GefenMuon's
  are ``muon.options``);
* ``state``: how Gefen's state becomes checkpoint entries and back (format
  v3 (and v2 loads) under agreed blocking, v1 under per-rank blocking).
"""

from gefen_titan.optim.container import GefenOptimizersContainer

__all__ = ["GefenOptimizersContainer"]
