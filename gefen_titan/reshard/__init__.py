"""Compact, reshardable Gefen checkpoints (see ``adapter`` and ``format``)."""

from .adapter import GefenCheckpointError, GefenStateAdapter

__all__ = ["GefenCheckpointError", "GefenStateAdapter"]
