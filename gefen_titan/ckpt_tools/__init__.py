"""Offline checkpoint tools: ``gefen-titan ckpt inspect | verify | convert | export``.

Each runs as one process with no process group and no accelerator, reading
through ``gefen_titan.checkpoint.io.storage`` (local folders and fsspec URLs):

* ``inspection``: what a checkpoint holds (format, mesh, per optimizer the
  parameters with shapes, periods and bytes, codebooks, counters, model and
  data-loader entries);
* ``verify``: every file and every byte, every record and tiling, before an
  expensive job resumes;
* ``convert``: Gefen (formats v2 and v3) state to AdamW moments and back, into a new
  checkpoint that ``train.py`` resumes.

``cli`` is the command line (``gefen-titan ckpt ...``, ``python -m
gefen_titan.ckpt_tools ...``); docs/ckpt_tools.md describes the commands.
"""

from gefen_titan.ckpt_tools.view import Checkpoint, CkptError

__all__ = ["Checkpoint", "CkptError"]
