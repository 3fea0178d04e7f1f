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

The code is in three modules: this one (the loader: what a load reads, and
the decision above), ``gefen_titan.data.elastic_dataset`` (the dataset each
rank or worker reads, and its new state after a reshard) and
``gefen_titan.data.elastic_passes`` (which documents and tokens go where).
The loader is built the way torchtitan builds its own, through
``ParallelAwareDataloader`` and its per-rank entries (pinned by
``tests/unit/test_contract_torchtitan.py``); torchdata's saved loader layout
is read and written by ``gefen_titan.data.loader_state``.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import re
from dataclasses import dataclass, fields
from typing import Any, Literal

from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.tools.logging import logger

from gefen_titan.checkpoint.format.unpickling import loads_loader_state
from gefen_titan.data.corpus import register_datasets
from gefen_titan.data.elastic_dataset import (
    PASS_KEY,
    STREAM_KEY,
    WORKER_KEY,
    DataLoaderReshardError,
    ElasticTextDataset,
    SourceUnit,
)
from gefen_titan.data.elastic_passes import decode_pass
from gefen_titan.data.loader_state import (
    BATCH_SIZE_KEY,
    SavedLoader,
    build_loader_state,
    read_saved_loader,
    saved_workers,
)
from gefen_titan.data.stream_reshard import as_worker

__all__ = ["ON_DP_CHANGE_KEY", "ElasticTextDataLoader"]

ON_DP_CHANGE_KEY = "dataloader.on_dp_change"
"""The recipe key every resharding error names."""

_RANK_KEY = re.compile(r"^dp_rank_(\d+)$")


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

        @classmethod
        def from_torchtitan(cls, stock: Any) -> Any:
            """torchtitan's ``HuggingFaceTextDataLoader.Config`` (what its base config
            functions build) as this class with the same values, so a recipe that
            names no loader still resumes at another data-parallel size. Any other
            config (another loader's, or ours) is returned as it is."""
            if type(stock) is not HuggingFaceTextDataLoader.Config:
                return stock
            return cls(**{f.name: getattr(stock, f.name) for f in fields(stock) if f.init})

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

    def _unpickle(self, raw: bytes, rank: int | None = None) -> Any:
        """A rank's pickled loader state, read with plain data only (``checkpoint.format.unpickling``)."""
        return loads_loader_state(raw, f"dataloader.dp_rank_{self.dp_rank if rank is None else rank}")

    def _load_own(self, state_dict: dict[str, Any]) -> None:
        """torchtitan's ``ParallelAwareDataloader.load_state_dict`` (an empty
        state loads nothing, a missing rank warns, the world size must match),
        its ``pickle.loads`` of the rank's state restricted to plain data."""
        if not state_dict:
            return
        if self._rank_id not in state_dict:
            logger.warning(f"DataLoader state is empty for dp rank {self.dp_rank}, expected key {self._rank_id}")
            return
        if self.dp_world_size != state_dict["world_size"]:
            raise DataLoaderReshardError(f"the checkpoint's data loader was saved with {state_dict['world_size']} "
                                         f"data-parallel ranks, this run has {self.dp_world_size}")
        StatefulDataLoader.load_state_dict(self, self._unpickle(state_dict[self._rank_id]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        request, self._load_request = self._load_request, None
        if not state_dict and request is None:
            return  # empty state is valid (torchtitan)
        src_world = state_dict.get("world_size", request[1] if request else None)
        if src_world is None:
            return self._load_own(state_dict)
        src_world = int(src_world)
        if src_world == self.dp_world_size:
            own = state_dict.get(self._rank_id)
            src_workers = saved_workers(self._unpickle(own)) if own is not None else self.num_workers
            if src_workers == self.num_workers:
                if own is not None and self.num_workers and self.dataset.map_style:
                    self._check_worker_positions(self._unpickle(own))
                return self._load_own(state_dict)
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
            units = [u for r in sorted(sources)
                     for u in self._source_units(self._unpickle(sources[r], r), src_world, r)]
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
            what = f"{len(decode_pass(states[0][PASS_KEY]))} unread documents"
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
            raise DataLoaderReshardError(
                f"source rank {rank}'s loader state is not one this loader reads ({e})"
            ) from None
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
