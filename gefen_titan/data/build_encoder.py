"""How a token-dataset build (``gefen_titan.data.indexed_build``) tokenizes its documents.

The build reads documents in order and writes them in resumable chunks; the
tokenizer is what takes the hours, so this module runs it on a chunk at a
time, in this process or in a pool of worker processes, and hands the chunks
back in input order: the bytes written do not depend on the number of
workers. Each document is encoded as torchtitan's text dataset encodes it
(``tokenizer.encode(text, add_bos=True, add_eos=True)``).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["Encoder", "document_chunks", "encode"]


def document_chunks(docs: Iterator[tuple[str, int]], size: int) -> Iterator[tuple[list[str], int]]:
    """Documents in lists of ``size``, each with the input bytes read after it."""
    texts: list[str] = []
    at = 0
    for text, at in docs:
        texts.append(text)
        if len(texts) == size:
            yield texts, at
            texts = []
    if texts:
        yield texts, at


_worker_tokenizer: Any = None


def _worker_init(tokenizer: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def encode(texts: list[str], tokenizer: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, flat ids) of ``texts`` as torchtitan's text dataset encodes them."""
    tok = tokenizer if tokenizer is not None else _worker_tokenizer
    ids = [tok.encode(t, add_bos=True, add_eos=True) for t in texts]
    lengths = np.fromiter((len(x) for x in ids), dtype="<i8", count=len(ids))
    flat = np.fromiter((t for x in ids for t in x), dtype=np.int64, count=int(lengths.sum()))
    return lengths, flat


class Encoder:
    """Tokenizes chunks in order, in this process or in a pool of ``workers``.
    At most ``2 * workers`` chunks are in flight, so memory does not grow with
    the corpus. Workers are forked where the platform can (they only run the
    tokenizer, and a spawned one would spend seconds importing torch first),
    else spawned with the tokenizer pickled to each."""

    def __init__(self, tokenizer: Any, workers: int):
        self.tokenizer, self.workers, self.pool = tokenizer, workers, None

    def __enter__(self) -> Encoder:
        if self.workers > 1:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            self.pool = ctx.Pool(self.workers, initializer=_worker_init, initargs=(self.tokenizer,))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def map(self, chunks: Iterator[tuple[list[str], int]]) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        if self.pool is None:
            for texts, at in chunks:
                yield (*encode(texts, self.tokenizer), at)
            return
        while True:
            window = [c for _, c in zip(range(2 * self.workers), chunks)]
            if not window:
                return
            for (lengths, flat), (_, at) in zip(self.pool.map(encode, [t for t, _ in window]), window):
                yield lengths, flat, at
