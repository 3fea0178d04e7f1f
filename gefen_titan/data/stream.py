"""``gefen_tiny_stream``: a local multi-file corpus read as a stream.

Large corpora are read with ``load_dataset(..., streaming=True)``: each
data-parallel rank gets every N-th file (or every N-th document when the
files do not divide the ranks) and its position is a ``datasets`` stream
state, not a document index. This dataset makes that path run offline, so
the elastic loader's streaming resume (``docs/data_resume.md``) is exercised
by a recipe (``recipes/llama_gefen_stream.toml``) and not only by tests.

``dataset_path`` names the files: a directory (its ``.jsonl``,
``.jsonl.gz`` and ``.parquet`` files, sorted by name), a glob pattern, or
one file. Every record needs a string ``text`` field. Unset, it is the
embedded ``gefen_tiny`` corpus cut into ``EMBEDDED_SHARDS`` contiguous
``.jsonl.gz`` files, written once under the cache directory
(``$GEFEN_TITAN_CACHE``, else ``~/.cache/gefen_titan``); ranks on one host
take a file lock, so they write it once. That default belongs to the
embedded corpus and is resolved there (``gefen_titan.data.corpus``, which
also registers this dataset with torchtitan); this module only reads files.
"""

from __future__ import annotations

import glob
import os

from datasets import IterableDataset, load_dataset

__all__ = ["STREAM_DATASET_NAME", "load_stream", "stream_files", "stream_of"]

STREAM_DATASET_NAME = "gefen_tiny_stream"
"""Name under which the stream is registered in torchtitan's DATASETS."""

_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def stream_files(path: str) -> list[str]:
    """The corpus files ``dataset_path`` names (sorted), or a clear error."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(_SUFFIXES)]
    elif any(c in path for c in "*?["):
        files = [f for f in glob.glob(path) if f.endswith(_SUFFIXES)]
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"{STREAM_DATASET_NAME}: dataset_path {path!r} is no file, directory or glob")
    files = sorted(files)
    if not files:
        raise FileNotFoundError(f"{STREAM_DATASET_NAME}: no {', '.join(_SUFFIXES)} files in {path!r}")
    kinds = {f.endswith(".parquet") for f in files}
    if len(kinds) > 1:
        raise ValueError(f"{STREAM_DATASET_NAME}: {path!r} mixes parquet and JSONL files")
    return files


def load_stream(path: str) -> IterableDataset:
    """The files ``path`` names (``stream_files``) as one ``datasets`` stream
    with one shard per file."""
    return stream_of(stream_files(path))


def stream_of(files: list[str]) -> IterableDataset:
    """``files`` (all JSONL or all parquet) as one ``datasets`` stream with one
    shard per file, in the order given."""
    builder = "parquet" if files[0].endswith(".parquet") else "json"
    return load_dataset(builder, data_files=files, split="train", streaming=True)
