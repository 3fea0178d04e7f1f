"""Elastic data-loader resume: the data stream continues when the DP degree changes.

torchtitan 0.3.0 checkpoints one opaque state per data-parallel rank
(``dataloader.dp_rank_{r}``) and refuses to load them at another DP degree
("dataloader resharding is not supported yet"); the only way through is
``exclude_from_loading = ["dataloader"]``, which silently starts the stream
over. ``ElasticTextDataLoader`` is torchtitan's ``HuggingFaceTextDataLoader``
plus one decision, ``dataloader.on_dp_change``:

* same layout (DP degree and ``num_workers``): torchtitan's own load,
  untouched (bit-identical batches);
* ``"continue"`` (default): what every source reading unit (a rank, or each
  of its DataLoader workers) had not read of its current pass goes to the new
  units, no document (and no token) repeated or skipped; each unit's leftover
  token buffer goes, whole and in order, to new unit ``u * V // U``. When a
  new rank has read its share it re-loops onto torchtitan's own M-rank layout
  (next epoch). Map-style data: the unread documents, in source order, are
  split contiguously among the new ranks. Streaming data: each source
  stream's remainder is replayed from its ``datasets`` state and partitioned
  among the new units that cover it (``gefen_titan.data.stream_reshard``);
* ``"restart"``: start the stream from the beginning, with a warning;
* ``"error"``: refuse, naming the recipe key.

Datasets whose position cannot say where a rank was (streams with a shuffle
buffer, mapped or interleaved streams, checkpoints of torchtitan's loader
with workers over map-style data) fail with an error that names
``dataloader.on_dp_change``. See ``docs/data_resume.md``.

A rank loading at another degree must read every source rank's entry, but DCP
only reads the keys the loader's ``state_dict()`` names. ``prepare_load`` (called
by ``GefenCheckpointManager.dcp_load`` with the checkpoint metadata) makes the
next ``state_dict()`` name the entries the checkpoint actually holds.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pickle
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataLoader,
    HuggingFaceTextDataset,
    _validate_dataset,
)
from torchtitan.tools.logging import logger

from gefen_titan.data.corpus import register_datasets
from gefen_titan.data.loader_state import (
    BATCH_SIZE_KEY,
    SavedLoader,
    build_loader_state,
    read_saved_loader,
    saved_workers,
)
from gefen_titan.data.stream_reshard import (
    StreamNotResumable,
    as_worker,
    check_resumable,
    current_worker,
    read_leaves,
    share_leaves,
    source_leaves,
)

__all__ = [
    "ON_DP_CHANGE_KEY",
    "PASS_KEY",
    "STREAM_KEY",
    "WORKER_KEY",
    "DataLoaderReshardError",
    "ElasticTextDataLoader",
    "ElasticTextDataset",
    "SourceUnit",
    "lift_dataloader_config",
    "plan_reshard",
]

ON_DP_CHANGE_KEY = "dataloader.on_dp_change"
"""The recipe key every resharding error names."""

PASS_KEY = "elastic_pass"
"""Extra dataset-state entry, present only while a rank reads a resharded
pass of a map-style dataset."""

STREAM_KEY = "elastic_stream"
"""Extra dataset-state entry, present only while a rank reads a resharded
pass of a streaming dataset: ``{"epoch", "leaves"}``."""

WORKER_KEY = "elastic_worker"
"""Extra dataset-state entry in a DataLoader worker: ``[worker, num_workers]``."""

_RANK_KEY = re.compile(r"^dp_rank_(\d+)$")


class DataLoaderReshardError(ValueError):
    """The data-loader state cannot be carried across a layout change."""


# --------------------------------------------------------------------------
# Which documents a rank reads: global indices into the full dataset.


def _index_dataset(num_documents: int) -> Dataset:
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
    block = split_dataset_by_node(_index_dataset(num_documents), rank, world)
    if epoch > 0:
        block = block.shuffle(seed=42 + epoch)
    return _column(block)


def _encode_pass(indices: np.ndarray, num_documents: int) -> dict[str, Any]:
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


def _decode_pass(encoded: dict[str, Any]) -> np.ndarray:
    if "runs" in encoded:
        runs = np.frombuffer(encoded["runs"], dtype="<i8").reshape(-1, 2)
        if not len(runs):
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs])
    return np.frombuffer(encoded["indices"], dtype="<i8").astype(np.int64)


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


# --------------------------------------------------------------------------
# The dataset: torchtitan's, plus an explicit pass after a reshard.


@dataclass(frozen=True)
class SourceUnit:
    """One reading process of a source rank: the rank (``workers == 0``) or
    one of its DataLoader workers, with its dataset state at the save."""

    world: int
    rank: int
    workers: int
    worker: int
    state: dict[str, Any]


class ElasticTextDataset(HuggingFaceTextDataset):
    """``HuggingFaceTextDataset`` that can read an explicit remainder first.

    Until a reshard happens it is torchtitan's class, state included, with one
    difference: in a DataLoader worker, a map-style dataset reads only every
    ``num_workers``-th document of the rank's pass (torchtitan's workers each
    read the whole pass, so every document came ``num_workers`` times).

    After a reshard, the rank first reads what it was given: for map-style
    data a list of documents (``_pass``, global indices into the full
    dataset; saved as ``elastic_pass``), for streaming data a list of source
    stream leaves (``_stream``, see ``gefen_titan.data.stream_reshard``; saved as
    ``elastic_stream``). Then it re-loops onto torchtitan's own layout for its
    rank at the new degree.
    """

    def __init__(
        self,
        dataset_name: str,
        dataset_path: str | None,
        tokenizer: BaseTokenizer,
        seq_len: int = 2048,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = False,
    ) -> None:
        super().__init__(
            dataset_name=dataset_name,
            dataset_path=dataset_path,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=infinite,
        )
        self._dataset_path = dataset_path
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._full: Dataset | IterableDataset | None = None
        self._pass: np.ndarray | None = None
        self._pass_state: dict[str, Any] | None = None
        self._stream: dict[str, Any] | None = None

    @property
    def map_style(self) -> bool:
        return isinstance(self._original_data, Dataset)

    def full_dataset(self) -> Dataset | IterableDataset:
        """The whole (unsplit) dataset, loaded again on first use."""
        if self._full is None:
            path, loader, _ = _validate_dataset(self.dataset_name, self._dataset_path)
            full = loader(path)
            if not self.map_style:
                try:
                    check_resumable(full, self.dataset_name)
                except StreamNotResumable as e:
                    raise DataLoaderReshardError(str(e)) from None
            elif not isinstance(full, Dataset):
                raise DataLoaderReshardError(
                    f"dataset {self.dataset_name!r} loads as {type(full).__name__}, not a "
                    "map-style datasets.Dataset"
                )
            else:
                mine = split_dataset_by_node(_index_dataset(len(full)), self._dp_rank, self._dp_world_size)
                if len(mine) != len(self._original_data):
                    raise DataLoaderReshardError(
                        f"dataset {self.dataset_name!r} loaded again with {len(full)} documents, "
                        "which does not match this rank's share; the loader is not deterministic"
                    )
            self._full = full
        return self._full

    def _decode(self, encoded: dict[str, Any]) -> np.ndarray:
        num_documents = len(self.full_dataset())
        if encoded["num_documents"] != num_documents:
            raise DataLoaderReshardError(
                f"the checkpoint was written for a dataset of {encoded['num_documents']} "
                f"documents, this one has {num_documents}"
            )
        return _decode_pass(encoded)

    def source_pass(self, state: dict[str, Any], world: int, rank: int) -> np.ndarray:
        """Source rank ``rank`` of ``world``'s current pass, from its saved state."""
        if state.get(PASS_KEY) is not None:
            return self._decode(state[PASS_KEY])
        return block_pass(len(self.full_dataset()), world, rank, int(state.get("epoch", 0)))

    def _set_pass(self, encoded: dict[str, Any] | None) -> None:
        if encoded is None:
            self._pass = self._pass_state = self._full = None
            return
        self._pass = self._decode(encoded)
        self._pass_state = encoded
        self._data = self.full_dataset().select(self._pass, keep_in_memory=True)

    def _get_data_iter(self):
        if self._stream is not None:
            return read_leaves(self.full_dataset(), self._stream["leaves"])
        worker, workers = current_worker()
        if not self.map_style or workers <= 1:
            return super()._get_data_iter()
        # Worker w reads documents w, w + W, ... of the rank's pass;
        # _sample_idx counts this worker's documents.
        data = self._data.shard(num_shards=workers, index=worker, contiguous=False)
        return iter([]) if self._sample_idx >= len(data) else iter(data.skip(self._sample_idx))

    def reloop(self) -> None:
        if self._pass is not None:  # the resharded pass is done: back to torchtitan's layout
            self._set_pass(None)
        if self._stream is not None:  # _data's epoch is the pass's: torchtitan's reloop adds one
            self._stream = self._full = None
        super().reloop()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # torchtitan hands out its live buffers and later extends them in
        # place; a worker's state is pickled by a queue thread after the
        # worker has moved on, so it must not share them.
        for key in ("inputs_buffer", "labels_buffer", "positions_buffer"):
            state[key] = list(state[key])
        if self._pass_state is not None:
            state[PASS_KEY] = self._pass_state
        if self._stream is not None:
            state[STREAM_KEY] = copy.deepcopy(self._stream)
        worker, workers = current_worker()
        if workers:
            state[WORKER_KEY] = [worker, workers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.map_style and state_dict.get(STREAM_KEY) is not None:
            self._inputs_buffer = state_dict["inputs_buffer"]
            self._labels_buffer = state_dict["labels_buffer"]
            self._positions_buffer = state_dict["positions_buffer"]
            self._stream = copy.deepcopy(state_dict[STREAM_KEY])
            self._data.set_epoch(int(self._stream["epoch"]))
        else:
            self._stream = None
            super().load_state_dict(state_dict)
            self._set_pass(state_dict.get(PASS_KEY) if self.map_style else None)
        # The buffers are extended in place from now on: not the caller's lists.
        self._inputs_buffer = list(self._inputs_buffer)
        self._labels_buffer = list(self._labels_buffer)
        self._positions_buffer = list(self._positions_buffer)

    def source_copy(self, world: int, rank: int) -> ElasticTextDataset:
        """A fresh dataset reading as rank ``rank`` of ``world`` (sharing this
        one's tokenizer and full dataset), to replay what that rank read."""
        other = copy.copy(self)
        other._dp_rank, other._dp_world_size = rank, world
        other._original_data = other._data = split_dataset_by_node(self.full_dataset(), rank, world)
        other._pass = other._pass_state = other._stream = None
        other._inputs_buffer, other._labels_buffer, other._positions_buffer = [], [], []
        other._sample_idx, other._epoch = 0, 0
        return other

    # -- resharding -------------------------------------------------------

    def resharded_units(self, units: list[SourceUnit], parts: int, part: int, workers: int) -> list[dict[str, Any]]:
        """This rank's new dataset states, one per reading unit (its
        ``workers`` workers, or itself), from the source units' states.

        The destination is part ``part`` of ``parts`` (the new DP layout, or
        ``parts = 1`` when only this rank's own workers change); its units are
        ``part * max(workers, 1) + w`` of ``parts * max(workers, 1)``. Raises
        ``DataLoaderReshardError`` (nothing changed) where a position cannot
        be continued exactly.
        """
        per_part = max(workers, 1)
        dst_units = parts * per_part
        if self.map_style:
            kind_ok = all("sample_idx" in u.state for u in units)
        else:
            kind_ok = all(STREAM_KEY in u.state or "data" in u.state for u in units)
        if not kind_ok:
            now, then = ("map-style", "a stream") if self.map_style else ("a stream", "map-style")
            raise DataLoaderReshardError(
                f"dataset {self.dataset_name!r} is {now} now but the checkpoint's positions are "
                f"those of {then} dataset"
            )
        if self.map_style:
            remaining, epoch = self._map_remaining(units)
            mine = plan_reshard([p for p, _ in remaining], [i for _, i in remaining], parts)[part]
            carried: dict[str, Any] = {PASS_KEY: _encode_pass(mine, len(self.full_dataset())), "sample_idx": 0, "epoch": epoch}
        else:
            self.full_dataset()  # refuses a stream whose position is not exact
            remainders = []
            for u in units:
                if u.state.get(STREAM_KEY) is not None:
                    remainders.append(copy.deepcopy(u.state[STREAM_KEY]["leaves"]))
                    continue
                try:
                    remainders.append(source_leaves(u.state["data"], u.world, u.rank, u.workers, u.worker))
                except StreamNotResumable as e:
                    raise DataLoaderReshardError(str(e)) from None
            epoch = max(_unit_epoch(u.state) for u in units)

        states = []
        for w in range(per_part):
            dst = part * per_part + w
            state = _carried_buffers([u.state for u in units], dst, dst_units)
            if self.map_style:
                state.update(copy.deepcopy(carried))
            else:
                state[STREAM_KEY] = {"epoch": epoch, "leaves": share_leaves(remainders, dst_units, dst)}
            if workers:
                state[WORKER_KEY] = [w, workers]
            states.append(state)
        return states

    def _map_remaining(self, units: list[SourceUnit]) -> tuple[list[tuple[np.ndarray, int]], int]:
        out = []
        for u in units:
            rank_pass = self.source_pass(u.state, u.world, u.rank)
            if u.workers:
                if u.state.get(WORKER_KEY) != [u.worker, u.workers]:
                    raise DataLoaderReshardError(
                        f"source rank {u.rank}'s worker {u.worker} was saved by a loader whose "
                        "workers each read the rank's whole share (torchtitan's "
                        "HuggingFaceTextDataLoader with num_workers > 0), so its position does not "
                        "say which documents the rank had read"
                    )
                rank_pass = rank_pass[u.worker::u.workers]
            i = int(u.state["sample_idx"])
            if not 0 <= i <= len(rank_pass):
                raise DataLoaderReshardError(
                    f"source rank {u.rank} read {i} documents of a pass of {len(rank_pass)}; the dataset changed"
                )
            out.append((rank_pass, i))
        return out, max(int(u.state.get("epoch", 0)) for u in units)


def _unit_epoch(state: dict[str, Any]) -> int:
    if state.get(STREAM_KEY) is not None:
        return int(state[STREAM_KEY]["epoch"])
    return int(state["data"].get("epoch", 0))


def _carried_buffers(states: list[dict[str, Any]], dst: int, dst_units: int) -> dict[str, list[int]]:
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


# --------------------------------------------------------------------------
# The dataloader component.


class ElasticTextDataLoader(HuggingFaceTextDataLoader):
    """torchtitan's text dataloader whose state survives a DP degree change."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        on_dp_change: Literal["continue", "restart", "error"] = "continue"
        """What a resume does when the checkpoint was written at another
        data-parallel degree (or with another ``num_workers``). "continue":
        the new ranks together read exactly the documents (and leftover
        tokens) the old ranks had not read yet, then start the next epoch on
        the new layout; map-style and plain streaming datasets, others fail
        naming this key. "restart": start the data stream from the beginning
        (already-seen documents are seen again), with a warning. "error":
        refuse to resume. The same layout always resumes exactly."""

        def __post_init__(self) -> None:
            if self.on_dp_change not in ("continue", "restart", "error"):
                raise ValueError(
                    f"{ON_DP_CHANGE_KEY} must be one of 'continue', 'restart', 'error', "
                    f"got {self.on_dp_change!r}"
                )

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs,
    ):
        # torchtitan resolves dataset names in its DATASETS registry.
        register_datasets()
        # HuggingFaceTextDataLoader.__init__ with our dataset class.
        dataset = ElasticTextDataset(
            dataset_name=config.dataset,
            dataset_path=config.dataset_path,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=config.infinite,
        )
        dataloader_kwargs = {
            "num_workers": config.num_workers,
            "persistent_workers": config.persistent_workers,
            "pin_memory": config.pin_memory,
            "prefetch_factor": config.prefetch_factor,
            "snapshot_every_n_steps": snapshot_every_n_steps,
            "batch_size": local_batch_size,
        }
        ParallelAwareDataloader.__init__(
            self, dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **dataloader_kwargs
        )
        self.on_dp_change = config.on_dp_change
        self._load_request: tuple[list[str], int | None] | None = None

    # -- DCP: which keys a load reads -------------------------------------

    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str = "dataloader.") -> None:
        """Before ``dcp.load``: name the entries this rank must read.

        (The hook's signature is shared with the optimizer container's, see
        ``GefenCheckpointManager.dcp_load``; only the metadata is needed here.)

        Same degree: nothing changes (this rank reads ``dp_rank_{r}`` as in
        torchtitan). Another degree: read ``world_size`` and, for
        "continue", every source rank's entry.
        """
        names = [k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix)]
        ranks = sorted(int(m.group(1)) for m in map(_RANK_KEY.match, names) if m)
        if not ranks or ranks == list(range(self.dp_world_size)):
            self._load_request = None
            return
        keys = [f"dp_rank_{r}" for r in ranks] if self.on_dp_change == "continue" else []
        if "world_size" in names:
            keys.append("world_size")
        self._load_request = (keys, len(ranks))

    def abort_load(self) -> None:
        """After ``dcp.load`` (also when it failed): back to normal saving."""
        self._load_request = None

    def state_dict(self) -> dict[str, Any]:
        if self._load_request is not None:
            keys, _ = self._load_request
            return {k: (self.dp_world_size if k == "world_size" else b"") for k in keys}
        if not self.num_workers:
            return super().state_dict()
        # With workers, a reshard may have to replay the batches read since the
        # last snapshot, and a batch's size is not in torchdata's state.
        state = {**StatefulDataLoader.state_dict(self), BATCH_SIZE_KEY: self.batch_size}
        return {self._rank_id: pickle.dumps(state), "world_size": self.dp_world_size}

    # -- loading ----------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        request, self._load_request = self._load_request, None
        if not state_dict and request is None:
            return  # empty state is valid (torchtitan)
        src_world = state_dict.get("world_size", request[1] if request else None)
        if src_world is None:
            return super().load_state_dict(state_dict)  # torchtitan, untouched
        src_world = int(src_world)
        if src_world == self.dp_world_size:
            own = state_dict.get(self._rank_id)
            src_workers = saved_workers(pickle.loads(own)) if own is not None else self.num_workers
            if src_workers == self.num_workers:
                if own is not None and self.num_workers and self.dataset.map_style:
                    self._check_worker_positions(pickle.loads(own))
                return super().load_state_dict(state_dict)  # torchtitan, untouched
            change = f"{src_workers} -> {self.num_workers} data-loader worker processes per rank"
            saved = f"with {src_workers} data-loader workers per rank, this run has {self.num_workers}"
            sources, parts, part = {self.dp_rank: own}, 1, 0
        else:
            change = f"{src_world} -> {self.dp_world_size} data-parallel ranks"
            saved = f"with {src_world} data-parallel ranks, this run has {self.dp_world_size}"
            sources, parts, part = None, self.dp_world_size, self.dp_rank

        if self.on_dp_change == "error":
            raise DataLoaderReshardError(
                f"the checkpoint's data loader was saved {saved}; {ON_DP_CHANGE_KEY} = \"error\" "
                f"refuses to resume. Set {ON_DP_CHANGE_KEY} = \"continue\" to carry the data stream "
                "over, or \"restart\" to start it over."
            )
        if self.on_dp_change == "restart":
            logger.warning(
                f"Data loader: checkpoint saved with {change}; {ON_DP_CHANGE_KEY} = \"restart\": "
                "the data stream starts over from the beginning (documents already trained on "
                "will be seen again)."
            )
            return

        try:
            if sources is None:
                missing = [r for r in range(src_world) if f"dp_rank_{r}" not in state_dict]
                if missing:
                    raise DataLoaderReshardError(
                        f"this rank received only {src_world - len(missing)} of the {src_world} source "
                        "ranks' states; load through gefen_titan's GefenCheckpointManager (it calls "
                        "the data loader's prepare_load before dcp.load)"
                    )
                sources = {r: state_dict[f"dp_rank_{r}"] for r in range(src_world)}
            units = [u for r in sorted(sources) for u in self._source_units(pickle.loads(sources[r]), src_world, r)]
            states = self.dataset.resharded_units(units, parts, part, self.num_workers)
        except DataLoaderReshardError as e:
            raise DataLoaderReshardError(
                f"cannot continue the data stream across {change}: {e}. Set {ON_DP_CHANGE_KEY} = "
                "\"restart\" to start the stream over from the beginning, or resume with the "
                "checkpoint's layout."
            ) from None

        StatefulDataLoader.load_state_dict(self, {})  # drop any iterator: the next state is a fresh one
        StatefulDataLoader.load_state_dict(self, build_loader_state(StatefulDataLoader.state_dict(self), states))
        if self.dataset.map_style:
            what = f"{len(_decode_pass(states[0][PASS_KEY]))} unread documents"
        else:
            streams = {(leaf["world"], leaf["rank"], leaf["workers"], leaf["worker"])
                       for state in states for leaf in state[STREAM_KEY]["leaves"]}
            what = f"the unread rest of {len(streams)} source streams"
        logger.info(
            f"Data loader resharded ({change}): dp rank {self.dp_rank} reads {what} and "
            f"{sum(len(s['inputs_buffer']) for s in states)} carried tokens, then the next epoch "
            "on the new layout."
        )

    def _source_units(self, state: dict[str, Any], world: int, rank: int) -> list[SourceUnit]:
        """Source rank ``rank``'s units with their dataset states at the save."""
        try:
            saved = read_saved_loader(state)
        except (KeyError, ValueError) as e:
            raise DataLoaderReshardError(f"source rank {rank}'s loader state is not one this loader reads ({e})") from None
        states = saved.dataset_states
        if any(s is None for s in states):
            raise DataLoaderReshardError(f"source rank {rank}'s state holds no dataset position")
        if saved.steps_since_snapshot:
            states = self._replay_since_snapshot(saved, world, rank)
        return [SourceUnit(world, rank, saved.workers, w, s) for w, s in enumerate(states)]

    def _replay_since_snapshot(self, saved: SavedLoader, world: int, rank: int) -> list[dict[str, Any]]:
        """The workers' states after the batches read since the snapshot, by
        reading them again here as torchdata's resume would: batch after
        batch from the next worker in turn, skipping workers that ran out."""
        if saved.batch_size is None:
            raise DataLoaderReshardError(
                f"source rank {rank} saved {saved.steps_since_snapshot} batches after its workers' last "
                "snapshot without its batch size (a torchtitan loader), so where its workers were "
                "cannot be rebuilt"
            )
        n = saved.workers
        copies = [self.dataset.source_copy(world, rank) for _ in range(n)]
        for w, (c, s) in enumerate(zip(copies, saved.dataset_states)):
            with as_worker(w, n):
                c.load_state_dict(copy.deepcopy(s))
        iters: list[Any] = [None] * n
        active = [not e for e in saved.ended]
        w, done = saved.last_yielded_worker, 0
        while done < saved.steps_since_snapshot and any(active):
            w = (w + 1) % n
            if not active[w]:
                continue
            with as_worker(w, n):
                iters[w] = iters[w] or iter(copies[w])
                got = sum(1 for _ in itertools.islice(iters[w], saved.batch_size))
            if got == 0:
                active[w] = False
                continue
            done += 1
        if done < saved.steps_since_snapshot:
            raise DataLoaderReshardError(
                f"source rank {rank}'s workers ran out of data replaying the batches read since their "
                "snapshot; the dataset changed"
            )
        states = []
        for w, c in enumerate(copies):
            with as_worker(w, n):
                states.append(c.state_dict())
        return states

    def _check_worker_positions(self, state: dict[str, Any]) -> None:
        """Same layout with workers, map-style: the positions must be this
        loader's per-worker ones, not torchtitan's whole-share ones."""
        for w, s in enumerate(read_saved_loader(state).dataset_states):
            if s is not None and s.get(WORKER_KEY) != [w, self.num_workers]:
                raise DataLoaderReshardError(
                    f"the checkpoint's data loader worker {w} read the rank's whole share (torchtitan's "
                    "HuggingFaceTextDataLoader with num_workers > 0 gives every worker the same "
                    "documents), so its position means something else here. Resume with "
                    "checkpoint.exclude_from_loading = [\"dataloader\"] to start the data over."
                )


def lift_dataloader_config(cfg: Any) -> Any:
    """``HuggingFaceTextDataLoader.Config`` -> ``ElasticTextDataLoader.Config``
    (same field values); any other config, including ours, is returned as is."""
    if type(cfg) is not HuggingFaceTextDataLoader.Config:
        return cfg
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    return ElasticTextDataLoader.Config(**values)
