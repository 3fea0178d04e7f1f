"""Checkpoints: the format, the files, and the manager that loads them.

Three wings, each a layer of its own (import-linter's checkpoint contract in
``pyproject.toml``: a wing imports only the wings below it):

* ``format/`` (bottom): what is on disk and how it decodes, named by no
  reader: the keys and records (``schema``, ``schema_records``), each kind's
  description (``kinds``), the ``.digests`` file (``digests``, ``digest_format``, ``digest_keys``),
  the pickles inside a checkpoint read without running code (``unpickling``,
  ``pickle_budget``) and the bounded opening of its files (``files``);
* ``checks/``: what a load checks of what it reads, without a live model, in
  one list (``load_checks``) that the offline tools run too: ``.metadata``'s
  fields, the records stage, the byte entries' values;
* ``io/`` (top): DCP's storage readers and writers that run those checks on
  every byte before it is used (``reading``, ``item_reads``), write v3's raw
  entries and ``.digests`` (``writing``), for local folders and fsspec URLs
  alike (``storage``).

At the top: ``manager`` (``GefenCheckpointManager``, torchtitan's manager told
the checkpoint's layout before a load), ``errors`` (``GefenCheckpointError``
and the messages every rank raises together), the manager's log lines, its
preflight, progress bars and the report text the offline tools share.

Nothing here knows the optimizer container: ``gefen_titan.optim.checkpointing``
and each kind's folder (``gefen_titan.optim.kinds``) build their entries from
this format.
"""

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.manager import GefenCheckpointManager, LoadPreparer

__all__ = ["GefenCheckpointError", "GefenCheckpointManager", "LoadPreparer"]
