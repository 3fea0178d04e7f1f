"""One trainer, many damaged checkpoints: each resume must be refused with nothing live changed.

``resume_flipped(argv)`` runs on every rank (``processes.run_ranks``):
``RECIPE ARGS... --copies OUT LOAD_STEP PREVIOUS_STEP FOLDER...``. It builds
the recipe's trainer once, then for each checkpoint folder points the
trainer's checkpoint manager at it and loads ``LOAD_STEP``: the load must
raise ``GefenCheckpointError`` and leave this rank's live parameters,
optimizer state and step as they were. Last, it loads ``PREVIOUS_STEP`` of
the first folder, which must succeed. Each rank writes what it saw to
``OUT/rank{r}.json``; the test judges.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.logging import init_logger

from gefen_titan import patches
from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.train import build_config


def _live(trainer) -> list[torch.Tensor]:
    """Copies of this rank's live tensors: parameter shards and optimizer state."""
    out = []
    for model in trainer.model_parts:
        out += [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
                for p in model.parameters()]
    for opt in trainer.optimizers.optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    out.append((v.to_local() if hasattr(v, "to_local") else v).detach().clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def resume_flipped(argv: list[str]) -> None:
    cut = argv.index("--copies")
    out, load_step, previous, folders = argv[cut + 1], int(argv[cut + 2]), int(argv[cut + 3]), argv[cut + 4:]
    init_logger()
    patches.apply_all()  # as train.py's main, before torchtitan's components are built
    config = build_config(argv[:cut])
    sl.init_structured_logger(source="training", output_dir=config.dump_folder,
                              enable=config.debug.enable_structured_logging)
    trainer = config.build()
    try:
        ckpt = trainer.checkpointer
        seen = []
        for folder in folders:
            before, step = _live(trainer), trainer.step
            ckpt.folder = folder
            try:
                ckpt.load(step=load_step)
                verdict = {"folder": folder, "loaded": True}
            except GefenCheckpointError as e:
                verdict = {"folder": folder, "loaded": False, "error": str(e)}
            verdict["unchanged"] = _same(before, _live(trainer)) and trainer.step == step
            seen.append(verdict)
        ckpt.folder = folders[0]
        ckpt.load(step=previous)
        result = {"flips": seen, "previous_step": trainer.step}
        with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
    finally:
        trainer.close()
