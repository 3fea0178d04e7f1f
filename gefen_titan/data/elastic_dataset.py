"""The dataset of the elastic loader: torchtitan's text dataset, plus a pass given to it.

``ElasticTextDataset`` is what each rank (or DataLoader worker) of
``gefen_titan.data.elastic.ElasticTextDataLoader`` reads. Until a reshard it
is torchtitan's ``HuggingFaceTextDataset``; after one, it reads first what
the new layout gave it (the unread documents of a map-style dataset, or the
unread leaves of source streams) and then re-loops onto torchtitan's layout.
``resharded_units`` computes those new states from the source units' saved
ones; which documents and tokens go where is ``gefen_titan.data.elastic_passes``
(map-style) and ``gefen_titan.data.stream_reshard`` (streams).

Subclasses torchtitan 0.3.0's ``HuggingFaceTextDataset`` and works with its
private state on purpose (``_original_data``, ``_data``, ``_sample_idx``,
``_epoch``, the token buffers, ``_get_data_iter``, ``_validate_dataset``):
there is no public way to read or set where it is.
``tests/unit/test_contract_torchtitan.py`` pins them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataset,
    _validate_dataset,
)

from gefen_titan.data.elastic_passes import (
    block_pass,
    carried_buffers,
    decode_pass,
    encode_pass,
    index_dataset,
    plan_reshard,
)
from gefen_titan.data.stream_reshard import (
    StreamNotResumable,
    check_resumable,
    current_worker,
    read_leaves,
    share_leaves,
    source_leaves,
)
from gefen_titan.errors import UserError

__all__ = [
    "PASS_KEY",
    "STREAM_KEY",
    "WORKER_KEY",
    "DataLoaderPositionError",
    "DataLoaderReshardError",
    "ElasticTextDataset",
    "SourceUnit",
]

PASS_KEY = "elastic_pass"
"""Extra dataset-state entry, present only while a rank reads a resharded
pass of a map-style dataset."""

STREAM_KEY = "elastic_stream"
"""Extra dataset-state entry, present only while a rank reads a resharded
pass of a streaming dataset: ``{"epoch", "leaves"}``."""

WORKER_KEY = "elastic_worker"
"""Extra dataset-state entry in a DataLoader worker: ``[worker, num_workers]``."""


class DataLoaderReshardError(UserError, ValueError):
    """The data-loader state cannot be carried across a layout change."""


class DataLoaderPositionError(UserError, ValueError):
    """A saved data loader position beyond the documents its reader reads (``ElasticTextDataset``)."""


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
                mine = split_dataset_by_node(index_dataset(len(full)), self._dp_rank, self._dp_world_size)
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
        return decode_pass(encoded)

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
            if self.map_style:
                self._check_position(state_dict)  # before anything of this dataset changes
            self._stream = None
            super().load_state_dict(state_dict)
            self._set_pass(state_dict.get(PASS_KEY) if self.map_style else None)
        # The buffers are extended in place from now on: not the caller's lists.
        self._inputs_buffer = list(self._inputs_buffer)
        self._labels_buffer = list(self._labels_buffer)
        self._positions_buffer = list(self._positions_buffer)

    def _check_position(self, state_dict: dict[str, Any]) -> None:
        """A map-style state's ``sample_idx`` (documents read this epoch by this rank, or by this worker of
        it) within the documents it reads: its pass's (after a reshard) or its share of the dataset, split
        among the workers as ``_get_data_iter`` splits it. Beyond them torchtitan's resume skips past the
        end and starts the next epoch: other data than the run saved (issue 50). The entry stage already
        refused a non-int or one outside [0, 2^53] (``checkpoint.checks.entry_values``)."""
        position = state_dict.get("sample_idx", 0)
        encoded = state_dict.get(PASS_KEY)
        documents = len(self._decode(encoded)) if encoded is not None else len(self._original_data)
        worker, workers = current_worker()
        if workers > 1:  # worker w reads documents w, w + W, ... (_get_data_iter)
            documents = max(0, (documents - worker + workers - 1) // workers)
        if type(position) is not int or not 0 <= position <= documents:
            who = f"worker {worker} of dp rank {self._dp_rank}" if workers > 1 else f"dp rank {self._dp_rank}"
            raise DataLoaderPositionError(
                f"the checkpoint's data loader state says {who} read {position!r} documents this epoch "
                f"(sample_idx), and it reads {documents:,} of dataset {self.dataset_name!r}: a state of another "
                "dataset, or edited. Resume with the dataset it was saved with, or with "
                "checkpoint.exclude_from_loading = [\"dataloader\"] to start the data over. Nothing of the "
                "data loader was loaded.")

    def source_copy(self, world: int, rank: int) -> ElasticTextDataset:
        """A fresh dataset reading as rank ``rank`` of ``world`` (sharing this
        one's tokenizer and full dataset), to replay what that rank read."""
        data = split_dataset_by_node(self.full_dataset(), rank, world)
        other = copy.copy(self)
        other._read_from_start(world, rank, data)  # noqa: SLF001 - a copy of this class
        return other

    def _read_from_start(self, world: int, rank: int, data: Dataset | IterableDataset) -> None:
        """Read ``data`` as rank ``rank`` of ``world``, from its beginning, with no pass."""
        self._dp_rank, self._dp_world_size = rank, world
        self._original_data = self._data = data
        self._pass = self._pass_state = self._stream = None
        self._inputs_buffer, self._labels_buffer, self._positions_buffer = [], [], []
        self._sample_idx, self._epoch = 0, 0

    # -- resharding -------------------------------------------------------

    def resharded_units(
        self, units: list[SourceUnit], parts: int, part: int, workers: int
    ) -> list[dict[str, Any]]:
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
            carried: dict[str, Any] = {
                PASS_KEY: encode_pass(mine, len(self.full_dataset())), "sample_idx": 0, "epoch": epoch
            }
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
            state = carried_buffers([u.state for u in units], dst, dst_units)
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
