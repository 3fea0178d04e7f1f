"""Where checkpoints are read from: local folders and fsspec URLs alike.

torchtitan 0.3.0 writes checkpoints to local paths or to fsspec URLs
(``s3://``, ``gs://``, ``file://``, ...; ``torchtitan.tools.filesystem``) and
DCP picks its storage from the checkpoint id. Every read gefen-titan makes
outside torchtitan's own ``dcp.load`` (the metadata before a load, the small
header and record reads, the ``ckpt`` tools) goes through here, so it sees
the same storage torchtitan wrote to.
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import StorageReader
from torchtitan.tools import filesystem

__all__ = ["is_remote", "read_metadata", "storage_reader"]


def is_remote(checkpoint_id: str | os.PathLike) -> bool:
    """Whether ``checkpoint_id`` is an fsspec URL (torchtitan's rule)."""
    return filesystem.is_remote(checkpoint_id)


def storage_reader(checkpoint_id: str | os.PathLike) -> StorageReader:
    """A DCP reader for a checkpoint folder: fsspec for URLs, the file system otherwise."""
    checkpoint_id = os.fspath(checkpoint_id)
    if is_remote(checkpoint_id):
        return FsspecReader(checkpoint_id)
    return FileSystemReader(checkpoint_id)


def read_metadata(checkpoint_id: str | os.PathLike) -> Metadata:
    """The checkpoint's DCP metadata (``.metadata``); raises OSError or CheckpointException."""
    return storage_reader(checkpoint_id).read_metadata()
