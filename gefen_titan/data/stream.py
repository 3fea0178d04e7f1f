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
take a file lock, so they write it once.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from pathlib import Path
from typing import Any

from datasets import IterableDataset, load_dataset

from gefen_titan.data.corpus import DEFAULT_DATASET_PATH, _sample_text, read_jsonl_texts
from gefen_titan.data.indexed import file_sha256
from gefen_titan.data.indexed_build import _locked, default_cache_dir

__all__ = ["EMBEDDED_SHARDS", "EMBEDDED_STREAM", "STREAM_DATASET_NAME", "embedded_shards", "load_stream", "stream_files"]

STREAM_DATASET_NAME = "gefen_tiny_stream"

EMBEDDED_STREAM = "builtin://tiny_corpus"
"""The default ``dataset_path``: the embedded corpus, cut into files."""

EMBEDDED_SHARDS = 12
"""Files the embedded corpus is cut into: divides 1, 2, 3, 4, 6 and 12 ranks
(each rank reads whole files); 8 ranks fall back to every 8th document."""

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


def embedded_shards(cache_dir: str | os.PathLike | None = None, shards: int = EMBEDDED_SHARDS) -> list[str]:
    """The embedded corpus as ``shards`` contiguous ``.jsonl.gz`` files (document
    i in file ``i * shards // n``), written on first use."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out = cache / "stream" / f"tiny_corpus-{file_sha256(DEFAULT_DATASET_PATH)[:12]}-{shards}"
    names = [out / f"part-{k:05d}-of-{shards:05d}.jsonl.gz" for k in range(shards)]
    with _locked(out.with_name(out.name + ".lock")):
        if not all(n.is_file() for n in names):
            texts = read_jsonl_texts(DEFAULT_DATASET_PATH)
            out.mkdir(parents=True, exist_ok=True)
            for k, name in enumerate(names):
                part = texts[k * len(texts) // shards:(k + 1) * len(texts) // shards]
                tmp = name.with_name(name.name + ".tmp")
                with gzip.GzipFile(tmp, "wb", mtime=0) as f:
                    f.write("".join(json.dumps({"text": t}) + "\n" for t in part).encode("utf-8"))
                os.replace(tmp, name)
    return [str(n) for n in names]


def load_stream(path: str) -> IterableDataset:
    """torchtitan ``DatasetConfig.loader``: the files as one ``datasets`` stream
    with one shard per file."""
    files = embedded_shards() if path == EMBEDDED_STREAM else stream_files(path)
    builder = "parquet" if files[0].endswith(".parquet") else "json"
    return load_dataset(builder, data_files=files, split="train", streaming=True)


def _config() -> Any:
    from torchtitan.hf_datasets import DatasetConfig

    return DatasetConfig(path=EMBEDDED_STREAM, loader=load_stream, sample_processor=_sample_text)
