"""The held-out split: which documents of a corpus training never sees.

Why: a quality benchmark that compares optimizers on training loss rewards
memorising the corpus (the embedded one is ~0.86M tokens, and a 1000-step run
at 2 ranks reads it ~2.5 times). An evaluation needs documents the run never
trained on, and a definition of them that every process, every run and every
rank count agrees on without coordination.

The split is by document, by content: a document is held out when the
SHA-256 of its UTF-8 text, read as a big-endian integer (first 8 bytes), is a
multiple of ``HELD_OUT_EVERY`` (1 in 20, about 5%). Content and not position
decides, so reordering or appending to a corpus moves no document across
the split, and exact duplicates land on the same side (a held-out document
cannot reach training through a copy). Nothing is random: no seed, the same
split at any data-parallel size. On the embedded corpus: 142 of 2,977
documents held out, 41,763 of 868,366 tokens (BOS and EOS counted; the
packaged tokenizer), so 41,621 scored next-token labels; training keeps
2,835 documents, 826,603 tokens.

Opt-in: the datasets registered for it (``gefen_titan.data.corpus``) are
``gefen_tiny_train`` (the documents not held out, for ``[dataloader]
dataset``) and ``gefen_tiny_held_out`` (the held-out ones, for
``[validator.dataloader] dataset``); ``gefen_tiny`` stays the whole corpus,
so default runs and recorded curves are unchanged. Both read
``dataset_path`` when it is set, so any ``{"text": ...}`` JSONL file splits
the same way. The validator reads the held-out documents once, exactly, with
``gefen_titan.data.eval_loader`` (set ``validator.steps = -1``).

This module is only the rule (no I/O), so every side of the split reads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["HELD_OUT_DATASET_NAME", "HELD_OUT_EVERY", "TRAIN_DATASET_NAME", "is_held_out", "split_texts"]

HELD_OUT_EVERY = 20
"""One document in this many (by content hash) is held out: ~5% of the corpus,
enough tokens for a steady eval loss (~42k on the embedded corpus), few
enough that an eval pass costs a few training steps' forwards."""

TRAIN_DATASET_NAME = "gefen_tiny_train"
"""The corpus without its held-out documents, registered in torchtitan's DATASETS."""

HELD_OUT_DATASET_NAME = "gefen_tiny_held_out"
"""The held-out documents only, registered in torchtitan's DATASETS."""


def is_held_out(text: str) -> bool:
    """Whether the document ``text`` is held out (a pure function of its content)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_EVERY == 0


def split_texts(texts: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(train, held_out)``: the documents of ``texts`` on each side, each in
    its original order."""
    train: list[str] = []
    held_out: list[str] = []
    for text in texts:
        (held_out if is_held_out(text) else train).append(text)
    return train, held_out
