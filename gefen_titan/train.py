"""Entry point: ``python -m gefen_titan.train --job.config recipes/X.toml``.

The same as ``torchtitan.train.main`` except that the config comes from a
TOML recipe (``--job.config``) instead of ``--module/--config``; the rest of
the command line is torchtitan's, parsed by tyro over the recipe
(``gefen_titan.recipe.cli``). The recipe and the flags are read and checked
before ``config.build()`` creates any process group, so a bad recipe or flag
fails every rank the same way and at once.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.logging import init_logger, logger

from gefen_titan import patches
from gefen_titan.checkpoint import preflight
from gefen_titan.distributed import free_port
from gefen_titan.error_report import reported
from gefen_titan.recipe.cli import load_cli


def build_config(argv: list[str] | None = None):
    return load_cli(sys.argv[1:] if argv is None else argv).config


def single_process_env() -> None:
    """Let ``python -m gefen_titan.train`` run as one rank without torchrun.

    torchtitan reads the torchrun variables unconditionally; with none set we
    are the whole world.
    """
    if "LOCAL_RANK" in os.environ or "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


@record
def main(argv: list[str] | None = None) -> None:
    """Train; a user's error (``gefen_titan.errors.UserError``) ends it as one short block
    and exit status 1 (``gefen_titan.error_report``), any other keeps its traceback, and
    ``@record`` hands either to torchrun's error file."""
    with reported():
        run(argv)


def run(argv: list[str] | None = None) -> None:
    init_logger()
    # Before any torchtitan component is built; a no-op for what CUDA does not need.
    patches.apply_all()
    config = build_config(argv)
    # Before anything is built: a folder that is not a checkpoint is refused
    # here, and a checkpoint already at training.steps ends the run with what
    # to do (torchtitan would log "Training completed", or crash in its LR
    # scheduler for a step past the schedule).
    ckpt = config.checkpoint
    done = preflight.before_build(
        enable=ckpt.enable, folder=os.path.join(config.dump_folder, ckpt.folder), load_step=ckpt.load_step,
        initial_load_path=ckpt.initial_load_path, initial_load_model_only=ckpt.initial_load_model_only,
        from_hf=ckpt.initial_load_in_hf, steps=config.training.steps)
    if done is not None and not ckpt.create_seed_checkpoint:
        if os.environ.get("RANK", "0") == "0":  # every rank stops; one says why
            logger.warning(done)
        return
    single_process_env()
    sl.init_structured_logger(
        source="training",
        output_dir=config.dump_folder,
        enable=config.debug.enable_structured_logging,
    )

    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ValueError("Create a seed checkpoint with a single process (no sharding).")
            if not config.checkpoint.enable:
                raise ValueError("checkpoint.enable must be true to create a seed checkpoint.")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        # Free the trainer (and the collective work handles its modules and
        # hooks still hold, some only through reference cycles) while the
        # interpreter is whole: gloo work destroyed during interpreter
        # finalization can abort the process after a finished run (seen once
        # here: SIGABRT, "terminate called without an active exception").
        trainer = None
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
