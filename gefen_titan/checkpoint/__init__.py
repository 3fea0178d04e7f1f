"""Checkpoints: the format, the files, and the manager that loads them.

* ``schema`` (with ``schema_v1``, ``schema_muon``): the one definition of
  the Gefen checkpoint format (keys, records, their JSON, their checks,
  which tensors a version stores); ``docs/checkpoint_format.md`` is
  generated from it;
* ``manager``: ``GefenCheckpointManager``, torchtitan's manager told the
  checkpoint's layout before a load (``LoadPreparer``);
* ``storage``: every read and write, local folders and fsspec URLs alike;
* ``digests``: the ``.digests`` file (a digest of every stored byte; keyed,
  a MAC, with ``checkpoint.digest_key_env``);
* ``unpickling``: every pickle read from a checkpoint, restricted to
  allowlisted globals (reading a checkpoint never runs code from it);
* ``writing`` / ``reading``: the DCP writers (format v3's raw entries, and
  ``.digests``) and readers (raw entries; every byte checked before anything
  loaded is used);
* ``errors``: ``GefenCheckpointError`` and the messages every rank raises;
* ``reader`` / ``records``: an offline, single-process view of a checkpoint
  and its Gefen records (the ``gefen-titan ckpt`` tools);
* ``quant`` / ``kernels``: Gefen's dequantize/requantize arithmetic, the
  pure-torch reference and its Triton kernels.

Nothing here knows the optimizer container: ``gefen_titan.optim.checkpointing``
builds the entries of Gefen's state from this schema.
"""

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.manager import GefenCheckpointManager, LoadPreparer

__all__ = ["GefenCheckpointError", "GefenCheckpointManager", "LoadPreparer"]
