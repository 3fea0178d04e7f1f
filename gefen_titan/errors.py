"""What marks an error as the user's to fix: ``UserError``.

A recipe key mistyped, a checkpoint that cannot be loaded, a data file cut
short: the message of such an error is the whole story (what is wrong and
what to do), and a traceback around it, once per rank, only buries it. Every
error class of the package that describes bad input derives from
``UserError`` as well as from its builtin base (``ValueError``,
``RuntimeError``), so callers that catch those keep working; the entry point
(``gefen_titan.error_report``) prints a ``UserError`` as a short block with no
traceback, and leaves every other exception's traceback as it is.

This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """An error whose message says what is wrong with the user's input and what to do."""
