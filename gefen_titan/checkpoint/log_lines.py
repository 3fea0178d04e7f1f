"""The manager's save and load lines: which step, where, how big, from which mesh to which.

torchtitan logs "Saving the checkpoint." and "Loading the checkpoint from
<folder>." with nothing a person comparing two runs needs: the step, the
bytes, or the mesh a resume changes. The manager logs one line of its own
after each synchronous save (``saved``) and before each load (``loading``).

A checkpoint records no mesh by name, so the saved side is what its files
say (``written_by``: the ranks that wrote data files, and how one 2-D
tensor is cut into chunks), and the live side what the load's first 2-D
DTensor target says (its device mesh's dimension names and sizes, and its
cuts): the same tensor on both sides, so the two cuts compare directly.

torchtitan's two bare lines that these replace ("Saving the checkpoint." of a
synchronous save, "Loading the checkpoint from <folder>.") are dropped from its
log (``drop_superseded``, installed by the manager): a filter on the root logger,
which torchtitan logs through, matching only those messages of its checkpointer
module. Its "Staging the checkpoint." (async saves, which ``saved`` does not
cover) and its "Finished ... in N seconds." lines stay.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from gefen_titan.checkpoint.io import storage

__all__ = ["SupersededLines", "drop_superseded", "loading", "saved", "step_of", "written_by"]

_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP's data files: __<rank>_<n>.distcp


class SupersededLines(logging.Filter):
    """Drops torchtitan's checkpointer lines that ``saved`` and ``loading`` say with more."""

    MODULE = os.path.join("torchtitan", "components", "checkpointer", "dcp.py")

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.pathname.endswith(self.MODULE):
            return True
        message = record.getMessage()
        return not (message == "Saving the checkpoint." or message.startswith("Loading the checkpoint from "))


def drop_superseded(logger: logging.Logger | None = None) -> None:
    """Install ``SupersededLines`` on ``logger`` (default: the root logger, torchtitan's) once."""
    logger = logging.getLogger() if logger is None else logger
    if not any(isinstance(f, SupersededLines) for f in logger.filters):
        logger.addFilter(SupersededLines())


def step_of(checkpoint_id: str | os.PathLike) -> str:
    """The step a torchtitan checkpoint folder (``.../step-N``) holds, or the folder's name."""
    name = os.path.basename(os.fspath(checkpoint_id).rstrip("/"))
    m = re.fullmatch(r"step-(\d+)", name)
    return m.group(1) if m else name


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def saved(checkpoint_id: str | os.PathLike, seconds: float) -> str:
    """``Saved step N to FOLDER: X MB in Y s`` (the bytes of every file in the folder)."""
    try:
        total = sum(storage.file_size(checkpoint_id, f) or 0 for f in storage.list_files(checkpoint_id))
        size = _mb(total)
    except OSError:  # a store that cannot list: the line says so rather than failing a save that worked
        size = "size unknown"
    return f"Saved step {step_of(checkpoint_id)} to {os.fspath(checkpoint_id)}: {size} in {seconds:.2f} s"


def _cuts(offsets: list[tuple[int, ...]], dims: int) -> str:
    return " x ".join(str(len({o[d] for o in offsets})) for d in range(dims))


def written_by(metadata: Metadata) -> int:
    """How many ranks wrote data files (DCP names them ``__<rank>_<n>.distcp``)."""
    ranks = {m.group(1) for info in (metadata.storage_data or {}).values()
             if (m := _DATA_FILE.search(str(info.relative_path)))}
    return len(ranks)


def _live_cuts(t: DTensor) -> str:
    cuts = [1] * t.dim()
    for size, placement in zip(t.device_mesh.shape, t.placements):
        if placement.is_shard():
            cuts[placement.dim] *= size
    return " x ".join(map(str, cuts))


def loading(checkpoint_id: str | os.PathLike, metadata: Metadata | None, targets: dict[str, Any],
            world_size: int) -> str:
    """``Loading step N from FOLDER: saved by A ranks (NAME cut a x b), loading onto B ranks
    (mesh fsdp=B; NAME cut c x d)``; without metadata (nothing planned from it), the step and
    the live side only."""
    head = f"Loading step {step_of(checkpoint_id)} from {os.fspath(checkpoint_id)}"
    name = next((k for k, v in targets.items() if isinstance(v, DTensor) and v.dim() == 2
                 and (metadata is None or isinstance(metadata.state_dict_metadata.get(k), TensorStorageMetadata))),
                None)
    live = f"{world_size} rank{'s' if world_size != 1 else ''}"
    if name is not None:
        t = targets[name]
        mesh = ", ".join(f"{n}={s}" for n, s in zip(t.device_mesh.mesh_dim_names or (), t.device_mesh.shape))
        live += f" (mesh {mesh}; {name} cut {_live_cuts(t)})" if mesh else f" ({name} cut {_live_cuts(t)})"
    if metadata is None:
        return f"{head}: onto {live}"
    writers = written_by(metadata)
    saved_side = f"{writers} rank{'s' if writers != 1 else ''}"
    if name is not None:
        chunks = metadata.state_dict_metadata[name].chunks
        saved_side += f" ({name} cut {_cuts([tuple(c.offsets) for c in chunks], 2)})"
    return f"{head}: saved by {saved_side}, loading onto {live}"
