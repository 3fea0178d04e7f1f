"""The embedded default dataset ``gefen_tiny``, registered with torchtitan.

Why: the default recipe must train with no access to dataset or model hubs,
so the package ships a small corpus (CPython standard-library docstrings and
reference topics, PSF License; see ``assets/README.md``) and a 2048-id
byte-level BPE tokenizer trained on it (``scripts/build_assets.py`` rebuilds
both). This module has one job: make that corpus (or any other local
``{"text": ...}`` JSONL file) loadable by torchtitan's text dataloader under
the name ``gefen_tiny``, and the same corpus as a multi-file stream under
``gefen_tiny_stream`` (``gefen_titan.data.stream``), and its two sides of
the held-out split under ``gefen_tiny_train`` / ``gefen_tiny_held_out``
(``gefen_titan.data.held_out``: opt-in, for evaluating on documents training
never saw).

The loader parses the file itself and builds an in-memory map-style
``datasets.Dataset``. It never calls ``load_dataset``, so ranks loading at
the same time cannot race on the Hugging Face cache, nothing is written to
disk, and no network is touched. A map-style dataset also means torchtitan
splits documents across data-parallel ranks in disjoint contiguous blocks
(``split_dataset_by_node``) and checkpoints a plain sample index.

The stream's default ``dataset_path``, ``EMBEDDED_STREAM``, is this corpus
cut into ``EMBEDDED_SHARDS`` contiguous ``.jsonl.gz`` files, written once
under the cache directory (``gefen_titan.data.cache``; ranks on one host take
a file lock, so they write it once).

Usage: ``register_datasets()`` (the elastic data loader runs it), then set
``dataloader.dataset = "gefen_tiny"``; ``dataloader.dataset_path`` may name
another ``.jsonl`` or ``.jsonl.gz`` file, and ``hf_assets_path`` may be
``DEFAULT_TOKENIZER_PATH``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

from datasets import Dataset, IterableDataset
from torchtitan.hf_datasets import DatasetConfig, text_datasets

from gefen_titan.data.cache import default_cache_dir, locked
from gefen_titan.data.held_out import HELD_OUT_DATASET_NAME, TRAIN_DATASET_NAME, split_texts
from gefen_titan.data.indexed import file_sha256
from gefen_titan.data.stream import STREAM_DATASET_NAME, stream_files, stream_of

__all__ = [
    "DATASET_NAME",
    "DEFAULT_DATASET_PATH",
    "DEFAULT_TOKENIZER_PATH",
    "EMBEDDED_SHARDS",
    "EMBEDDED_STREAM",
    "GZIP_MAGIC",
    "embedded_shards",
    "load_held_out_dataset",
    "load_jsonl_dataset",
    "load_stream_dataset",
    "load_train_dataset",
    "read_jsonl_texts",
    "register_datasets",
    "sample_text",
]

_ASSETS = Path(__file__).resolve().parents[1] / "assets"  # gefen_titan/assets (package data)

DATASET_NAME = "gefen_tiny"
"""Name under which the corpus is registered in torchtitan's DATASETS."""

DEFAULT_DATASET_PATH = str(_ASSETS / "tiny_corpus" / "tiny_corpus.jsonl.gz")
"""The packaged corpus: gzip-compressed JSONL, one ``{"text": ...}`` per line."""

DEFAULT_TOKENIZER_PATH = str(_ASSETS / "tokenizer")
"""Directory with ``tokenizer.json`` + ``tokenizer_config.json`` (vocab 2048),
in the layout ``torchtitan.components.tokenizer.HuggingFaceTokenizer`` loads."""

EMBEDDED_STREAM = "builtin://tiny_corpus"
"""The default ``dataset_path`` of ``gefen_tiny_stream``: this corpus, cut into files."""

EMBEDDED_SHARDS = 12
"""Files the embedded corpus is cut into: divides 1, 2, 3, 4, 6 and 12 ranks
(each rank reads whole files); 8 ranks fall back to every 8th document."""

GZIP_MAGIC = b"\x1f\x8b"
"""First bytes of a gzip file: JSONL readers detect compression by content, not name."""


def read_jsonl_texts(path: str | os.PathLike) -> list[str]:
    """The ``"text"`` field of every non-blank line of a JSONL file.

    Gzip is detected from the file's magic bytes, not its name. Raises
    ``FileNotFoundError`` or ``ValueError`` (naming the file and line) rather
    than silently training on an empty or malformed corpus.
    """
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{DATASET_NAME}: dataset_path {path!r} is not a file "
            "(expected a .jsonl or .jsonl.gz file with a 'text' field per line)"
        )
    with open(path, "rb") as f:
        gzipped = f.read(2) == GZIP_MAGIC
    opener = gzip.open if gzipped else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'text' field")
            texts.append(text)
    if not texts:
        raise ValueError(f"{path}: no documents")
    return texts


def load_jsonl_dataset(path: str) -> Dataset:
    """torchtitan ``DatasetConfig.loader``: the file as an in-memory Dataset."""
    return Dataset.from_dict({"text": read_jsonl_texts(path)})


def load_train_dataset(path: str) -> Dataset:
    """torchtitan ``DatasetConfig.loader`` of ``gefen_tiny_train``: the file's
    documents that are not held out (``gefen_titan.data.held_out``), in order."""
    return Dataset.from_dict({"text": split_texts(read_jsonl_texts(path))[0]})


def load_held_out_dataset(path: str) -> Dataset:
    """torchtitan ``DatasetConfig.loader`` of ``gefen_tiny_held_out``: the
    file's held-out documents, in order."""
    return Dataset.from_dict({"text": split_texts(read_jsonl_texts(path))[1]})


def sample_text(sample: dict[str, Any]) -> str:
    """torchtitan ``DatasetConfig.sample_processor``: the record's text."""
    return sample["text"]


def embedded_shards(cache_dir: str | os.PathLike | None = None, shards: int = EMBEDDED_SHARDS) -> list[str]:
    """The embedded corpus as ``shards`` contiguous ``.jsonl.gz`` files (document
    i in file ``i * shards // n``), written on first use."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out = cache / "stream" / f"tiny_corpus-{file_sha256(DEFAULT_DATASET_PATH)[:12]}-{shards}"
    names = [out / f"part-{k:05d}-of-{shards:05d}.jsonl.gz" for k in range(shards)]
    with locked(out.with_name(out.name + ".lock")):
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


def load_stream_dataset(path: str) -> IterableDataset:
    """torchtitan ``DatasetConfig.loader`` of ``gefen_tiny_stream``: the files
    ``path`` names as one ``datasets`` stream with one shard per file
    (``EMBEDDED_STREAM``: this corpus's ``embedded_shards``)."""
    return stream_of(embedded_shards() if path == EMBEDDED_STREAM else stream_files(path))


_CONFIG = DatasetConfig(
    path=DEFAULT_DATASET_PATH,
    loader=load_jsonl_dataset,
    sample_processor=sample_text,
)

_TRAIN_CONFIG = DatasetConfig(
    path=DEFAULT_DATASET_PATH,
    loader=load_train_dataset,
    sample_processor=sample_text,
)

_HELD_OUT_CONFIG = DatasetConfig(
    path=DEFAULT_DATASET_PATH,
    loader=load_held_out_dataset,
    sample_processor=sample_text,
)

_STREAM_CONFIG = DatasetConfig(
    path=EMBEDDED_STREAM,
    loader=load_stream_dataset,
    sample_processor=sample_text,
)


def register_datasets() -> None:
    """Add ``gefen_tiny`` (and ``gefen_tiny_stream``, the same corpus read as
    a multi-file stream, ``gefen_titan.data.stream``; ``gefen_tiny_train`` and
    ``gefen_tiny_held_out``, its held-out split) to torchtitan's text DATASETS
    (idempotent).

    torchtitan looks the name up in a module-level dict when the dataloader
    is built, so this must have run in every rank's process before that;
    ``ElasticTextDataLoader`` does it. Call it yourself to read ``gefen_tiny``
    through torchtitan's own ``HuggingFaceTextDataLoader``.
    """
    text_datasets.DATASETS[DATASET_NAME] = _CONFIG
    text_datasets.DATASETS[STREAM_DATASET_NAME] = _STREAM_CONFIG
    text_datasets.DATASETS[TRAIN_DATASET_NAME] = _TRAIN_CONFIG
    text_datasets.DATASETS[HELD_OUT_DATASET_NAME] = _HELD_OUT_CONFIG
