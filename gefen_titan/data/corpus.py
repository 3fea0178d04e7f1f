"""The embedded default dataset ``gefen_tiny``, registered with torchtitan.

Why: the default recipe must train with no access to dataset or model hubs,
so the package ships a small corpus (CPython standard-library docstrings and
reference topics, PSF License; see ``assets/README.md``) and a 2048-id
byte-level BPE tokenizer trained on it (``scripts/build_assets.py`` rebuilds
both). This module has one job: make that corpus (or any other local
``{"text": ...}`` JSONL file) loadable by torchtitan's text dataloader under
the name ``gefen_tiny``.

The loader parses the file itself and builds an in-memory map-style
``datasets.Dataset``. It never calls ``load_dataset``, so ranks loading at
the same time cannot race on the Hugging Face cache, nothing is written to
disk, and no network is touched. A map-style dataset also means torchtitan
splits documents across data-parallel ranks in disjoint contiguous blocks
(``split_dataset_by_node``) and checkpoints a plain sample index.

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

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig

__all__ = [
    "DATASET_NAME",
    "DEFAULT_DATASET_PATH",
    "DEFAULT_TOKENIZER_PATH",
    "load_jsonl_dataset",
    "read_jsonl_texts",
    "register_datasets",
]

_ASSETS = Path(__file__).resolve().parents[1] / "assets"  # gefen_titan/assets (package data)

DATASET_NAME = "gefen_tiny"
"""Name under which the corpus is registered in torchtitan's DATASETS."""

DEFAULT_DATASET_PATH = str(_ASSETS / "tiny_corpus" / "tiny_corpus.jsonl.gz")
"""The packaged corpus: gzip-compressed JSONL, one ``{"text": ...}`` per line."""

DEFAULT_TOKENIZER_PATH = str(_ASSETS / "tokenizer")
"""Directory with ``tokenizer.json`` + ``tokenizer_config.json`` (vocab 2048),
in the layout ``torchtitan.components.tokenizer.HuggingFaceTokenizer`` loads."""

_GZIP_MAGIC = b"\x1f\x8b"


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
        gzipped = f.read(2) == _GZIP_MAGIC
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


def _sample_text(sample: dict[str, Any]) -> str:
    """torchtitan ``DatasetConfig.sample_processor``."""
    return sample["text"]


_CONFIG = DatasetConfig(
    path=DEFAULT_DATASET_PATH,
    loader=load_jsonl_dataset,
    sample_processor=_sample_text,
)


def register_datasets() -> None:
    """Add ``gefen_tiny`` (and ``gefen_tiny_stream``, the same corpus read as
    a multi-file stream, ``gefen_titan.data.stream``) to torchtitan's text
    DATASETS (idempotent).

    torchtitan looks the name up in a module-level dict when the dataloader
    is built, so this must have run in every rank's process before that;
    ``ElasticTextDataLoader`` does it. Call it yourself to read ``gefen_tiny``
    through torchtitan's own ``HuggingFaceTextDataLoader``.
    """
    from torchtitan.hf_datasets import text_datasets

    from gefen_titan.data import stream as stream_data

    text_datasets.DATASETS[DATASET_NAME] = _CONFIG
    text_datasets.DATASETS[stream_data.STREAM_DATASET_NAME] = stream_data._config()
