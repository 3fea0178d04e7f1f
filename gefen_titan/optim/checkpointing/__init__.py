"""How an optimizer's state becomes checkpoint entries, and back.

The optimizer container checkpoints every registered optimizer that keeps
state of its own shape through the ``StateAdapter`` its registry entry
builds (``OptimizerSpec.state``), and every other optimizer through
torchtitan's flat per-parameter state dict. A load is one small read of
every kind's records (``load_context``), the kinds check, then each
adapter's two-step load (``adapter``):

* ``sharded``: formats v3 (written) and v2 (loaded), the state sharded like
  the parameters and resharded by DCP alone; each kind's subclass is in its
  folder (``optim.kinds.gefen.sharded``: Gefen under agreed blocking;
  ``optim.kinds.gefen_muon.sharded``);
* format v1 (Gefen under per-rank blocking, re-blocked and requantized where
  the layout changed on load) is ``optim.kinds.gefen.per_rank``, with
  ``codebook_merge`` here and ``gefen_titan.optim.quant``.
The entries' keys and records are defined in ``gefen_titan.checkpoint.format.schema``.
"""

from gefen_titan.optim.checkpointing.adapter import StateAdapter
from gefen_titan.optim.checkpointing.load_context import FLAT_KIND, LoadContext, kinds_refusal, read_load_context

# The kinds' adapters are imported from their own folders (optim.kinds), never from here.
__all__ = ["FLAT_KIND", "LoadContext", "StateAdapter", "kinds_refusal", "read_load_context"]
