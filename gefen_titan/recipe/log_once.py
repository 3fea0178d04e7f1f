"""torchtitan's per-construction config warnings, once per process.

torchtitan 0.3.0's ``CheckpointManager.Config.__post_init__`` warns
"initial_load_model_only=True has no effect without an initial_load_path"
whenever it runs with its own defaults (``initial_load_model_only`` defaults
to True, the path to empty), and a config is constructed several times per
build: the base config function, ``GefenCheckpointManager.Config.from_torchtitan``,
tyro's copies while parsing the command line. So every rank of a run
printed it 4 times, and ``gefen-titan validate``, which builds a recipe's
config for every side it checks, 45 times (Python's last-resort handler,
with no "[titan]" prefix). The defaults are torchtitan's and stay (a user's
``--checkpoint.initial_load_path`` alone must keep loading the model only),
so the message is filtered instead: ``install`` puts one filter on
torchtitan's logger (the root logger, ``torchtitan.tools.logging.logger``;
a filter on a logger survives ``init_logger``'s ``handlers.clear()``), which
lets each message in ``ONCE`` through the first time only.
"""

from __future__ import annotations

import logging

__all__ = ["ONCE", "OncePerProcess", "install"]

# Prefixes of the messages shown once per process.
ONCE = ("initial_load_model_only=True has no effect without an initial_load_path",)


class OncePerProcess(logging.Filter):
    """Passes every record, except a message starting with one of ``prefixes`` after its first time."""

    def __init__(self, prefixes: tuple[str, ...] = ONCE) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        prefix = next((p for p in self.prefixes if message.startswith(p)), None)
        if prefix is None:
            return True
        if prefix in self.seen:
            return False
        self.seen.add(prefix)
        return True


def install(logger: logging.Logger | None = None) -> OncePerProcess:
    """The one ``OncePerProcess`` filter on ``logger`` (default: the root logger, torchtitan's), added on
    the first call of the process; later calls return it."""
    logger = logger if logger is not None else logging.getLogger()
    for f in logger.filters:
        if isinstance(f, OncePerProcess):
            return f
    f = OncePerProcess()
    logger.addFilter(f)
    return f
