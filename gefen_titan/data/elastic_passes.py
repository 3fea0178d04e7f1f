"""Which documents and leftover tokens each new rank reads after an elastic reshard.

The arithmetic of ``gefen_titan.data.elastic`` on plain arrays, with no
dataset or process involved: a map-style rank's pass (``block_pass``, global
document indices in torchtitan's reading order), how the unread rest of the
source ranks' passes is split among the new ranks (``plan_reshard``), a pass
in the compact form a checkpoint stores (``encode_pass`` / ``decode_pass``),
and where each source unit's leftover token buffer goes (``buffer_target``,
``carried_buffers``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from datasets import Dataset
from datasets.distributed import split_dataset_by_node

__all__ = [
    "block_pass",
    "buffer_target",
    "carried_buffers",
    "decode_pass",
    "encode_pass",
    "index_dataset",
    "plan_reshard",
]


def index_dataset(num_documents: int) -> Dataset:
    """A dataset whose one column ``i`` is the document index: what torchtitan's
    splits and shuffles do to it is what they do to the documents."""
    return Dataset.from_dict({"i": np.arange(num_documents, dtype=np.int64)})


def _column(ds: Dataset) -> np.ndarray:
    return np.asarray(ds.with_format("numpy")[:]["i"], dtype=np.int64) if len(ds) else np.zeros(0, np.int64)


def block_pass(num_documents: int, world: int, rank: int, epoch: int) -> np.ndarray:
    """Global document indices in the order torchtitan's rank ``rank`` of
    ``world`` reads them in ``epoch``.

    Replays torchtitan's own operations (``split_dataset_by_node``, then
    ``shuffle(seed=42 + epoch)`` from epoch 1) on a dataset of indices of the
    same length, so the order is whatever ``datasets`` does, not a copy of it.
    """
    block = split_dataset_by_node(index_dataset(num_documents), rank, world)
    if epoch > 0:
        block = block.shuffle(seed=42 + epoch)
    return _column(block)


def encode_pass(indices: np.ndarray, num_documents: int) -> dict[str, Any]:
    """Compact, pickle-friendly form: (start, stop) runs when that is smaller."""
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices):
        breaks = np.flatnonzero(np.diff(indices) != 1) + 1
        starts = indices[np.r_[0, breaks]]
        stops = indices[np.r_[breaks - 1, len(indices) - 1]] + 1
    else:
        starts = stops = np.zeros(0, np.int64)
    if 2 * len(starts) < len(indices):
        runs = np.stack([starts, stops], axis=1).astype("<i8")
        return {"num_documents": num_documents, "runs": runs.tobytes()}
    return {"num_documents": num_documents, "indices": indices.astype("<i8").tobytes()}


def decode_pass(encoded: dict[str, Any]) -> np.ndarray:
    """The document indices ``encode_pass`` stored."""
    if "runs" in encoded:
        runs = np.frombuffer(encoded["runs"], dtype="<i8").reshape(-1, 2)
        if not len(runs):
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs])
    return np.frombuffer(encoded["indices"], dtype="<i8").astype(np.int64)


def plan_reshard(
    passes: list[np.ndarray], sample_idx: list[int], dst_world: int
) -> list[np.ndarray]:
    """The documents each of ``dst_world`` new ranks reads first.

    ``passes[r]`` is source rank r's current pass (global document indices in
    its reading order) and ``sample_idx[r]`` how many of them it has read.
    The unread ones, source rank 0's first, are split into ``dst_world``
    contiguous parts, the first ``len % dst_world`` one longer (the split
    ``split_dataset_by_node`` makes).
    """
    remaining = [np.asarray(p, dtype=np.int64)[i:] for p, i in zip(passes, sample_idx)]
    flat = np.concatenate(remaining) if remaining else np.zeros(0, np.int64)
    return [np.asarray(part, dtype=np.int64) for part in np.array_split(flat, dst_world)]


def buffer_target(src_rank: int, src_world: int, dst_world: int) -> int:
    """New rank (or reading unit) that receives source rank (unit) ``src_rank``'s
    leftover tokens."""
    return src_rank * dst_world // src_world


def _normalized(positions: list[int]) -> list[int]:
    """Positions of a buffer whose first document may be cut: that document
    restarts at 0 (what torchtitan does to the head of every sample), so a
    buffer placed after another one never carries positions >= seq_len."""
    positions = list(positions)
    if positions and positions[0] > 0:
        offset = positions[0]
        for i, p in enumerate(positions):
            if p == 0:
                break
            positions[i] = p - offset
    return positions


def carried_buffers(states: list[dict[str, Any]], dst: int, dst_units: int) -> dict[str, list[int]]:
    """The leftover token buffers of the source units that go to destination
    unit ``dst``: source unit u's goes whole to ``u * dst_units // len(states)``,
    in source order."""
    inputs: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for u, state in enumerate(states):
        if buffer_target(u, len(states), dst_units) != dst:
            continue
        buf_in = list(state.get("inputs_buffer", []))
        buf_pos = list(state.get("positions_buffer", []))
        if len(buf_pos) != len(buf_in):  # pre-positions checkpoint: one document
            buf_pos = list(range(len(buf_in)))
        inputs += buf_in
        labels += list(state.get("labels_buffer", []))
        positions += _normalized(buf_pos)
    return {"inputs_buffer": inputs, "labels_buffer": labels, "positions_buffer": positions}
