"""What a person reads in the logs: no warning repeated per config build."""

from __future__ import annotations

import logging

from torchtitan.components.checkpoint import CheckpointManager

from gefen_titan.recipe import log_once
from gefen_titan.recipe.cli import load_cli

NO_EFFECT = "initial_load_model_only=True has no effect"


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("root", logging.WARNING, __file__, 1, message, None, None)


def test_once_per_process_passes_a_listed_message_once_and_others_always():
    f = log_once.OncePerProcess()
    listed = log_once.ONCE[0] + "."
    assert [f.filter(_record(listed)) for _ in range(3)] == [True, False, False]
    assert all(f.filter(_record("Saving the checkpoint.")) for _ in range(3))


def test_install_is_one_filter_per_logger():
    logger = logging.getLogger("gefen_titan.test_logs")
    first = log_once.install(logger)
    assert log_once.install(logger) is first
    assert [f for f in logger.filters if isinstance(f, log_once.OncePerProcess)] == [first]
    logger.removeFilter(first)


def test_a_recipe_build_shows_torchtitans_no_effect_warning_once(caplog):
    # torchtitan warns on every CheckpointManager.Config construction with its defaults;
    # a recipe build constructs several, and validate builds one per side.
    with caplog.at_level(logging.WARNING):
        load_cli(["--job.config", "recipes/llama_gefen.toml"])
        load_cli(["--job.config", "recipes/llama_gefen.toml"])
        CheckpointManager.Config()
        CheckpointManager.Config()
    assert sum(NO_EFFECT in r.getMessage() for r in caplog.records) <= 1
