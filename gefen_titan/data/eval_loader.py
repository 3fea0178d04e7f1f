"""The validator's data loader: one exact pass over a map-style dataset.

Why: torchtitan 0.3.0's validator (``[validator]``) reads a
``HuggingFaceTextDataLoader``. With ``validator.steps = -1`` (read the whole
set) each data-parallel rank packs its own contiguous block of documents and
stops when it runs out, so ranks run different numbers of batches and the
validator's per-batch all-reduce hangs (torchtitan warns so); with a fixed
``steps`` every rank stops after the same count, which either leaves each
rank's tail unscored or re-loops onto a reshuffled pass and scores some
documents twice. Neither is a loss "on exactly the held-out documents"
(``gefen_titan.data.held_out``).

``EvalTextDataLoader`` is torchtitan's loader with one change: a finite pass
(``infinite = False``, which the validator sets for ``steps = -1``) over a
map-style dataset packs the whole dataset as one stream, in document order
and the same way torchtitan packs training samples (BOS/EOS per document,
next-token labels within a document, positions restarting at each document
and at each chunk), into ``seq_len`` rows; pads the last row's labels with
``IGNORE_INDEX`` and adds all-ignored rows up to a multiple of
``dp_world_size * local_batch_size``; and gives DP rank ``r`` the ``r``-th
contiguous block of rows. Every rank then runs the same number of full
batches, every label token of every document is scored once, and the
validator's token-weighted mean (it counts labels that are not
``IGNORE_INDEX``) is the same number at any data-parallel size. Infinite
passes and streaming datasets are torchtitan's loader, unchanged.

The recipe layer makes every validator's loader this one
(``gefen_titan.data.registry.lift_validation_dataloader_config``); the
keys stay torchtitan's (``[validator.dataloader] dataset``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from datasets import Dataset
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, _validate_dataset

from gefen_titan.data.corpus import register_datasets

__all__ = ["EvalTextDataLoader", "OnePassDataset", "pack_one_pass", "rank_rows"]

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs, labels, positions: [rows, seq_len] each


def pack_one_pass(documents: list[list[int]], seq_len: int, row_multiple: int) -> Rows:
    """``documents`` (token ids, BOS and EOS included) packed as one stream into
    ``seq_len`` rows, the row count padded up to a multiple of ``row_multiple``.

    Each document contributes ``tokens[:-1]`` as inputs and ``tokens[1:]`` as
    labels, so no label crosses into the next document (torchtitan's rule);
    positions count from 0 in each document and restart at a row's start
    (torchtitan's ``_normalize_positions``). Padding is input 0, label
    ``IGNORE_INDEX``, position 0.
    """
    inputs = [t for doc in documents for t in doc[:-1]]
    labels = [t for doc in documents for t in doc[1:]]
    positions = [p for doc in documents for p in range(len(doc) - 1)]
    rows = -(-len(inputs) // seq_len)
    rows = max(1, -(-rows // row_multiple)) * row_multiple
    pad = rows * seq_len - len(inputs)
    x = torch.tensor(inputs + [0] * pad, dtype=torch.long).view(rows, seq_len)
    y = torch.tensor(labels + [IGNORE_INDEX] * pad, dtype=torch.long).view(rows, seq_len)
    pos = torch.tensor(positions + [0] * pad, dtype=torch.long).view(rows, seq_len)
    # A row that starts inside a document counts that document's positions from 0.
    for row in pos:
        offset = int(row[0])
        if offset:
            restart = (row == 0).nonzero()
            end = int(restart[0]) if len(restart) else seq_len
            row[:end] -= offset
    return x, y, pos


class OnePassDataset(IterableDataset):
    """One rank's rows of a packed pass: ``({"input", "positions"}, labels)`` per row."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows[0])

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        x, y, pos = self.rows
        for i in range(len(x)):
            yield {"input": x[i], "positions": pos[i]}, y[i]


def rank_rows(texts: list[str], encode: Callable[[str], list[int]], *, seq_len: int, local_batch_size: int,
              dp_rank: int, dp_world_size: int) -> Rows:
    """DP rank ``dp_rank``'s contiguous block of the packed pass over ``texts``."""
    x, y, pos = pack_one_pass([encode(t) for t in texts], seq_len, dp_world_size * local_batch_size)
    per = len(x) // dp_world_size
    block = slice(dp_rank * per, (dp_rank + 1) * per)
    return x[block], y[block], pos[block]


class EvalTextDataLoader(HuggingFaceTextDataLoader):
    """torchtitan's text loader whose finite pass over a map-style dataset is exact and rank-balanced."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        @classmethod
        def from_torchtitan(cls, stock: Any) -> Any:
            """torchtitan's ``HuggingFaceTextDataLoader.Config`` (the validator's
            default) as this class with the same values; any other config is
            returned as it is."""
            if type(stock) is not HuggingFaceTextDataLoader.Config:
                return stock
            return cls(**{f.name: getattr(stock, f.name) for f in fields(stock) if f.init})

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
        register_datasets()  # the validator may build this before any gefen_tiny* name is registered
        kw = dict(dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=tokenizer, seq_len=seq_len,
                  local_batch_size=local_batch_size, snapshot_every_n_steps=snapshot_every_n_steps, **kwargs)
        if config.infinite:
            HuggingFaceTextDataLoader.__init__(self, config, **kw)
            return
        path, load, text_of = _validate_dataset(config.dataset.lower(), config.dataset_path)
        data = load(path)
        if not isinstance(data, Dataset):  # a stream: torchtitan's loader (which loads it again, lazily)
            HuggingFaceTextDataLoader.__init__(self, config, **kw)
            return
        rows = rank_rows(
            [text_of(sample) for sample in data],
            lambda text: tokenizer.encode(text, add_bos=True, add_eos=True),
            seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size,
        )
        # Rows already tokenized in memory: no workers (each would replay the whole block).
        ParallelAwareDataloader.__init__(
            self, OnePassDataset(rows), dp_rank=dp_rank, dp_world_size=dp_world_size,
            batch_size=local_batch_size, snapshot_every_n_steps=snapshot_every_n_steps,
        )
