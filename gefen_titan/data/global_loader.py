"""A data loader whose global batches do not depend on the DP size.

Why: torchtitan's text loader gives each data-parallel rank its own block of
documents and packs tokens per rank, so a run resumed at another DP size reads
other batches than the uninterrupted run would have (``ElasticTextDataLoader``
avoids repeats and gaps, not that). Here, as in Megatron-style trainers, the
order is global (``global_order``: packed samples of a pre-tokenized,
memory-mapped dataset, shuffled per epoch) and a rank only takes its slice.

Slicing follows torchtitan's trainer, which calls ``next()`` on each rank's
loader once per microbatch (``gradient_accumulation_steps`` times a step,
times the pipeline microbatches): every ``next()`` consumes the next
``local_batch_size * dp_world_size`` stream positions, and DP rank ``r`` gets
the ``r``-th run of ``local_batch_size`` of them (Megatron's layout). One step
therefore reads global batch ``b`` = positions ``[b * G, (b + 1) * G)`` at
every DP size, provided ``training.global_batch_size`` (``G``) is fixed; the
recipe layer refuses a global-order recipe that leaves it unset or not
divisible (``gefen_titan.recipe.checks.check_global_order_batch``).

The state is one global position, ``consumed_samples``, the same on every
rank, saved as one replicated entry (``dataloader.global_order.*``) rather
than torchtitan's per-rank ``dataloader.dp_rank_{r}``, so a checkpoint written
at N ranks loads at any M with no resharding at all. ``prepare_load`` (called
by ``GefenCheckpointManager``) refuses, before anything is read, a checkpoint
whose loader state is not of this kind. See ``docs/data_order.md``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.tools.logging import logger

from gefen_titan.data.corpus import DATASET_NAME, DEFAULT_DATASET_PATH
from gefen_titan.data.global_order import GlobalSampleOrder
from gefen_titan.data.indexed import IndexedDataset
from gefen_titan.data.indexed_build import cached_dataset
from gefen_titan.errors import UserError

__all__ = ["RECIPE_SETTING", "STATE_KEY", "DataOrderError", "GlobalOrderDataLoader", "open_dataset"]

STATE_KEY = "global_order"
"""The dataloader's one state entry (a dict of plain values)."""

RECIPE_SETTING = 'dataloader.loader = "global_order"'
"""How recipes choose this loader; named in errors."""

STATE_VERSION = 1


class DataOrderError(UserError, ValueError):
    """The global-order loader cannot be built or resumed as configured."""


def open_dataset(
    dataset: str, dataset_path: str | None, tokenizer: BaseTokenizer, cache_dir: str = ""
) -> IndexedDataset:
    """The token dataset a config names, checked against the run's tokenizer.

    ``dataset_path`` a directory: a dataset built by
    ``scripts/build_indexed_dataset.py``. A ``.jsonl``/``.jsonl.gz``/``.txt``
    file: built on first use into ``cache_dir``. None with ``dataset =
    "gefen_tiny"``: the embedded corpus, likewise.
    """
    if dataset_path:
        path = os.path.expanduser(dataset_path)
        if os.path.isdir(path):
            return IndexedDataset.open(path, tokenizer)
        return cached_dataset(path, tokenizer, cache_dir or None)
    if dataset != DATASET_NAME:
        raise DataOrderError(
            f"dataloader.dataset = {dataset!r}: the global-order loader reads pre-tokenized datasets; "
            f"build one with scripts/build_indexed_dataset.py and set dataloader.dataset_path to it "
            f"(or use dataset = {DATASET_NAME!r}, the embedded corpus)"
        )
    return cached_dataset(DEFAULT_DATASET_PATH, tokenizer, cache_dir or None)


class GlobalOrderDataLoader(BaseDataLoader):
    """Global batches that are the same samples at every DP size."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "gefen_tiny"
        """"gefen_tiny" (the embedded corpus) when dataset_path is not set."""

        dataset_path: str | None = None
        """A token dataset directory (scripts/build_indexed_dataset.py), or a
        .jsonl / .jsonl.gz / .txt file, tokenized on first use into cache_dir."""

        seed: int = 42
        """Seeds the per-epoch permutation of the samples."""

        shuffle: bool = True
        """Permute the samples every epoch (false: dataset order, every epoch)."""

        infinite: bool = True
        """Start the next epoch after the last sample (false: stop after one epoch)."""

        cache_dir: str = ""
        """Where files are tokenized on first use ("" = $GEFEN_TITAN_CACHE, else
        ~/.cache/gefen_titan)."""

        def __post_init__(self) -> None:
            # open_dataset reads dataset_path alone when it is set: another
            # dataset name would be dropped without a word.
            if self.dataset_path and self.dataset != DATASET_NAME:
                raise ValueError(
                    f"dataloader.dataset = {self.dataset!r} is not read when dataloader.dataset_path is set "
                    "(the global-order loader reads the token dataset at dataset_path); leave dataset out"
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
        **kwargs: Any,  # snapshot_every_n_steps: there are no worker snapshots here
    ):
        if not 0 <= dp_rank < dp_world_size:
            raise DataOrderError(f"dp_rank {dp_rank} is not in [0, dp_world_size = {dp_world_size})")
        if local_batch_size < 1:
            raise DataOrderError(f"local_batch_size must be >= 1, got {local_batch_size}")
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.local_batch_size = local_batch_size
        self.infinite = config.infinite
        self.dataset = open_dataset(config.dataset, config.dataset_path, tokenizer, config.cache_dir)
        self.order = GlobalSampleOrder(self.dataset, seq_len, seed=config.seed, shuffle=config.shuffle)
        self.consumed_samples = 0
        """Stream positions consumed by all ranks together (the whole state)."""

    @property
    def samples_per_next(self) -> int:
        """Stream positions one ``next()`` consumes across all ranks."""
        return self.local_batch_size * self.dp_world_size

    # -- reading -----------------------------------------------------------

    def rank_sample_ids(self, start: int) -> np.ndarray:
        """This rank's sample ids in the microbatch starting at stream position ``start``."""
        return self.order.sample_ids(start + self.dp_rank * self.local_batch_size, self.local_batch_size)

    def batch_at(self, start: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This rank's ``(input_dict, labels)`` of the microbatch at ``start``."""
        inputs, labels, positions = self.order.read(self.rank_sample_ids(start))
        return (
            {"input": torch.from_numpy(inputs), "positions": torch.from_numpy(positions)},
            torch.from_numpy(labels),
        )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            start = self.consumed_samples
            if not self.infinite and start + self.samples_per_next > self.order.samples_per_epoch:
                logger.warning(f"Global-order dataset {self.dataset.path} has run out of data (infinite = false)")
                return
            batch = self.batch_at(start)
            self.consumed_samples = start + self.samples_per_next
            yield batch

    # -- checkpointing -----------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        """What the position means: resuming with any of it changed reads other samples."""
        return {
            "dataset": self.dataset.fingerprint,
            "seq_len": self.order.seq_len,
            "samples_per_epoch": self.order.samples_per_epoch,
            "seed": self.order.seed,
            "shuffle": self.order.shuffle,
        }

    def state_dict(self) -> dict[str, Any]:
        # The same on every rank: DCP keeps one copy (replicated entries are
        # deduplicated), and every rank of any DP size reads it back.
        return {
            STATE_KEY: {
                "version": STATE_VERSION,
                "consumed_samples": int(self.consumed_samples),
                **self._identity(),
                "dp_world_size": self.dp_world_size,
                "local_batch_size": self.local_batch_size,
            }
        }

    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str = "dataloader.") -> None:
        """Before ``dcp.load``: refuse a checkpoint without this loader's state
        (DCP would only say "Missing key"), naming the way through."""
        names = {k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix)}
        want = {f"{STATE_KEY}.{k}" for k in self.state_dict()[STATE_KEY]}
        if want <= names:
            return
        if any(n.startswith(f"{STATE_KEY}.") for n in names):
            raise DataOrderError(
                f"{checkpoint_id}: its global-order data loader state lacks "
                f"{', '.join(sorted(want - names))} (another gefen-titan version?); set "
                "checkpoint.exclude_from_loading = [\"dataloader\"] to start the data order over"
            )
        kind = "per-rank (torchtitan / elastic loader)" if any(n.startswith("dp_rank_") for n in names) else "no"
        raise DataOrderError(
            f"{checkpoint_id} holds {kind} data loader state, not a global-order position: it was "
            f"written without {RECIPE_SETTING}. Resume with the loader it was written with, or set "
            "checkpoint.exclude_from_loading = [\"dataloader\"] to start the global order from its "
            "first sample (documents already trained on are then seen again)."
        )

    def abort_load(self) -> None:
        """After ``dcp.load``: nothing to undo (``prepare_load`` only checks)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # nothing saved (torchtitan: valid)
        saved = state_dict.get(STATE_KEY)
        if not isinstance(saved, dict):
            raise DataOrderError(
                f"the checkpoint's data loader state has no {STATE_KEY!r} entry (keys: "
                f"{sorted(state_dict)}); it was written without {RECIPE_SETTING}. Set "
                "checkpoint.exclude_from_loading = [\"dataloader\"] to start the data order over."
            )
        if int(saved.get("version", -1)) != STATE_VERSION:
            raise DataOrderError(
                f"global-order state version {saved.get('version')!r}, this gefen-titan reads {STATE_VERSION}"
            )
        mine = self._identity()
        changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in mine.items() if saved.get(k) != v]
        if changed:
            raise DataOrderError(
                "the checkpoint's data position counts samples of another order ("
                + "; ".join(changed)
                + "): resuming would read other samples than the saved run. Use the saved run's "
                "dataset, training.seq_len, dataloader.seed and dataloader.shuffle, or set "
                "checkpoint.exclude_from_loading = [\"dataloader\"] to start this order over."
            )
        consumed = int(saved["consumed_samples"])
        if consumed < 0 or consumed % self.samples_per_next:
            raise DataOrderError(
                f"the checkpoint stopped at global sample {consumed}, which is not a multiple of "
                f"local_batch_size x dp degree = {self.local_batch_size} x {self.dp_world_size}: the "
                f"saved run (local batch {saved.get('local_batch_size')}, dp {saved.get('dp_world_size')}) "
                "used another training.global_batch_size. Resume with the saved run's global batch size."
            )
        self.consumed_samples = consumed
        logger.info(
            f"Global-order data loader resumes at sample {consumed} (epoch "
            f"{self.order.epoch_of(consumed)}), saved at dp {saved.get('dp_world_size')}, now dp "
            f"{self.dp_world_size}: the same global batches as the uninterrupted run."
        )
