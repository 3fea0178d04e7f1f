"""Elastic data-loader resume: the data stream continues when the DP degree changes.

torchtitan 0.3.0 checkpoints one opaque state per data-parallel rank
(``dataloader.dp_rank_{r}``) and refuses to load them at another DP degree
("dataloader resharding is not supported yet"); the only way through is
``exclude_from_loading = ["dataloader"]``, which silently starts the stream
over. ``ElasticTextDataLoader`` is torchtitan's ``HuggingFaceTextDataLoader``
plus one decision, ``dataloader.on_dp_change``:

* same DP degree: torchtitan's own load, untouched (bit-identical batches);
* ``"continue"`` (default): every source rank's unread documents of its
  current pass are gathered, in source-rank order, into one list that is split
  contiguously among the new ranks; each source rank's leftover token buffer
  goes, whole and in order, to new rank ``r * M // N``. Across all ranks no
  document (and no token) is repeated or skipped. When a new rank has read its
  share it re-loops onto torchtitan's own M-rank layout (next epoch);
* ``"restart"``: start the stream from the beginning, with a warning;
* ``"error"``: refuse, naming the recipe key.

Only map-style datasets (``datasets.Dataset``: the embedded ``gefen_tiny``,
local files loaded with ``load_dataset(..., streaming=False)``) can continue;
streaming/iterable datasets, or ``num_workers > 0``, fail with an error that
names ``dataloader.on_dp_change``. See ``docs/data_resume.md``.

A rank loading at another degree must read every source rank's entry, but DCP
only reads the keys the loader's ``state_dict()`` names. ``prepare_load`` (called
by ``GefenCheckpointManager.dcp_load`` with the checkpoint metadata) makes the
next ``state_dict()`` name the entries the checkpoint actually holds.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from datasets import Dataset
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

from .data import register_datasets

__all__ = [
    "ON_DP_CHANGE_KEY",
    "PASS_KEY",
    "DataLoaderReshardError",
    "ElasticTextDataLoader",
    "ElasticTextDataset",
    "lift_dataloader_config",
    "plan_reshard",
]

ON_DP_CHANGE_KEY = "dataloader.on_dp_change"
"""The recipe key every resharding error names."""

PASS_KEY = "elastic_pass"
"""Extra dataset-state entry, present only while a rank reads a resharded pass."""

_RANK_KEY = re.compile(r"^dp_rank_(\d+)$")


class DataLoaderReshardError(ValueError):
    """The data-loader state cannot be carried across a DP degree change."""


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
    """New rank that receives source rank ``src_rank``'s leftover tokens."""
    return src_rank * dst_world // src_world


# --------------------------------------------------------------------------
# The dataset: torchtitan's, plus an explicit pass after a reshard.


class ElasticTextDataset(HuggingFaceTextDataset):
    """``HuggingFaceTextDataset`` that can read an explicit list of documents.

    Until a reshard happens it is torchtitan's class, state included. After
    one, the rank first reads the documents it was given (``_pass``, global
    indices into the full dataset; saved in the state as ``elastic_pass``),
    then re-loops onto torchtitan's own layout for its rank at the new degree.
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
        self._full: Dataset | None = None
        self._pass: np.ndarray | None = None
        self._pass_state: dict[str, Any] | None = None

    @property
    def map_style(self) -> bool:
        return isinstance(self._original_data, Dataset)

    def full_dataset(self) -> Dataset:
        """The whole (unsplit) dataset, loaded again on first use."""
        if self._full is None:
            path, loader, _ = _validate_dataset(self.dataset_name, self._dataset_path)
            full = loader(path)
            if not isinstance(full, Dataset):
                raise DataLoaderReshardError(
                    f"dataset {self.dataset_name!r} loads as {type(full).__name__}, not a "
                    "map-style datasets.Dataset"
                )
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

    def reloop(self) -> None:
        if self._pass is not None:  # the resharded pass is done: back to torchtitan's layout
            self._set_pass(None)
        super().reloop()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._pass_state is not None:
            state[PASS_KEY] = self._pass_state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._set_pass(state_dict.get(PASS_KEY) if self.map_style else None)

    def resharded_state(self, sources: list[dict[str, Any]], src_world: int) -> dict[str, Any]:
        """This rank's dataset state, built from all ``src_world`` source states."""
        if not self.map_style:
            raise DataLoaderReshardError(
                f"dataset {self.dataset_name!r} is a streaming/iterable dataset, whose position "
                "cannot be split among a different number of ranks"
            )
        for r, state in enumerate(sources):
            if "sample_idx" not in state:
                raise DataLoaderReshardError(
                    f"source rank {r}'s state has no document index (iterable dataset state)"
                )
        dst_world, me = self._dp_world_size, self._dp_rank
        passes = [self.source_pass(s, src_world, r) for r, s in enumerate(sources)]
        idx = [int(s["sample_idx"]) for s in sources]
        for r, (p, i) in enumerate(zip(passes, idx)):
            if not 0 <= i <= len(p):
                raise DataLoaderReshardError(
                    f"source rank {r} read {i} documents of a pass of {len(p)}; the dataset changed"
                )
        mine = plan_reshard(passes, idx, dst_world)[me]

        inputs: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for r, state in enumerate(sources):
            if buffer_target(r, src_world, dst_world) != me:
                continue
            buf_in = list(state.get("inputs_buffer", []))
            buf_pos = list(state.get("positions_buffer", []))
            if len(buf_pos) != len(buf_in):  # pre-positions checkpoint: one document
                buf_pos = list(range(len(buf_in)))
            inputs += buf_in
            labels += list(state.get("labels_buffer", []))
            positions += _normalized(buf_pos)
        return {
            "inputs_buffer": inputs,
            "labels_buffer": labels,
            "positions_buffer": positions,
            "sample_idx": 0,
            "epoch": max(int(s.get("epoch", 0)) for s in sources),
            PASS_KEY: _encode_pass(mine, len(self.full_dataset())),
        }


# --------------------------------------------------------------------------
# The dataloader component.


class ElasticTextDataLoader(HuggingFaceTextDataLoader):
    """torchtitan's text dataloader whose state survives a DP degree change."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        on_dp_change: Literal["continue", "restart", "error"] = "continue"
        """What a resume does when the checkpoint was written at another
        data-parallel degree. "continue": the new ranks together read exactly
        the documents (and leftover tokens) the old ranks had not read yet,
        then start the next epoch on the new layout; map-style datasets only,
        others fail naming this key. "restart": start the data stream from the
        beginning (already-seen documents are seen again), with a warning.
        "error": refuse to resume. The same degree always resumes exactly."""

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
        if self._load_request is None:
            return super().state_dict()
        keys, _ = self._load_request
        return {k: (self.dp_world_size if k == "world_size" else b"") for k in keys}

    # -- loading ----------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        request, self._load_request = self._load_request, None
        if not state_dict and request is None:
            return  # empty state is valid (torchtitan)
        src_world = state_dict.get("world_size", request[1] if request else None)
        if src_world is None or int(src_world) == self.dp_world_size:
            return super().load_state_dict(state_dict)  # torchtitan, untouched
        src_world = int(src_world)
        change = f"{src_world} -> {self.dp_world_size} data-parallel ranks"

        if self.on_dp_change == "error":
            raise DataLoaderReshardError(
                f"the checkpoint's data loader was saved with {src_world} data-parallel ranks, "
                f"this run has {self.dp_world_size}; {ON_DP_CHANGE_KEY} = \"error\" refuses to "
                f"resume. Set {ON_DP_CHANGE_KEY} = \"continue\" to carry the data stream over, "
                "or \"restart\" to start it over."
            )
        if self.on_dp_change == "restart":
            logger.warning(
                f"Data loader: checkpoint saved with {change}; {ON_DP_CHANGE_KEY} = \"restart\": "
                "the data stream starts over from the beginning (documents already trained on "
                "will be seen again)."
            )
            return

        try:
            missing = [r for r in range(src_world) if f"dp_rank_{r}" not in state_dict]
            if missing:
                raise DataLoaderReshardError(
                    f"this rank received only {src_world - len(missing)} of the {src_world} source "
                    "ranks' states; load through gefen_titan's GefenCheckpointManager (it calls "
                    "the data loader's prepare_load before dcp.load)"
                )
            sources = [pickle.loads(state_dict[f"dp_rank_{r}"]) for r in range(src_world)]
            for r, s in enumerate(sources):
                if "dataset_state" not in s:
                    raise DataLoaderReshardError(
                        f"source rank {r} was saved with worker processes (num_workers > 0)"
                    )
            dataset_state = self.dataset.resharded_state([s["dataset_state"] for s in sources], src_world)
        except DataLoaderReshardError as e:
            raise DataLoaderReshardError(
                f"cannot continue the data stream across {change}: {e}. Set {ON_DP_CHANGE_KEY} = "
                "\"restart\" to start the stream over from the beginning, or resume with "
                f"{src_world} data-parallel ranks."
            ) from None

        fresh = StatefulDataLoader.state_dict(self)
        fresh["dataset_state"] = dataset_state
        StatefulDataLoader.load_state_dict(self, fresh)
        owed = len(_decode_pass(dataset_state[PASS_KEY]))
        logger.info(
            f"Data loader resharded ({change}): dp rank {self.dp_rank} reads {owed} unread documents "
            f"and {len(dataset_state['inputs_buffer'])} carried tokens, then epoch "
            f"{dataset_state['epoch'] + 1} on the new layout."
        )


def lift_dataloader_config(cfg: Any) -> Any:
    """``HuggingFaceTextDataLoader.Config`` -> ``ElasticTextDataLoader.Config``
    (same field values); any other config, including ours, is returned as is."""
    if type(cfg) is not HuggingFaceTextDataLoader.Config:
        return cfg
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    return ElasticTextDataLoader.Config(**values)
