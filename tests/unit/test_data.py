"""The embedded corpus and tokenizer load through torchtitan's own classes.

Covers gefen_titan/data/corpus.py and gefen_titan/assets/: the tokenizer as
torchtitan's HuggingFaceTokenizer sees it, the ``gefen_tiny`` dataset as
HuggingFaceTextDataset sees it (shapes, id range, rank split), and a
user-given ``dataset_path``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os

import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets import text_datasets
from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataLoader,
    HuggingFaceTextDataset,
)

from gefen_titan.data import corpus as data

VOCAB_SIZE = 2048  # torchtitan llama3 "debugmodel"
SEQ_LEN = 256


@pytest.fixture(scope="module")
def tokenizer() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return data.read_jsonl_texts(data.DEFAULT_DATASET_PATH)


@pytest.fixture
def recording(monkeypatch):
    """Register gefen_tiny with a sample_processor that records each text seen.

    Returns a function mapping a dataset to the list it records into.
    """
    data.register_datasets()
    seen: dict[int, list[str]] = {}

    def make(key: int):
        def processor(sample):
            seen.setdefault(key, []).append(sample["text"])
            return sample["text"]

        return processor

    def build(key: int, **kwargs) -> HuggingFaceTextDataset:
        cfg = text_datasets.DATASETS[data.DATASET_NAME]
        monkeypatch.setitem(
            text_datasets.DATASETS,
            data.DATASET_NAME,
            dataclasses.replace(cfg, sample_processor=make(key)),
        )
        seen[key] = []
        return HuggingFaceTextDataset(dataset_name=data.DATASET_NAME, **kwargs)

    return build, seen


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def test_packaged_paths_exist():
    assert os.path.isfile(data.DEFAULT_DATASET_PATH)
    assert os.path.isfile(os.path.join(data.DEFAULT_TOKENIZER_PATH, "tokenizer.json"))
    assert os.path.isfile(os.path.join(data.DEFAULT_TOKENIZER_PATH, "tokenizer_config.json"))


def test_tokenizer_vocab_is_exactly_2048(tokenizer):
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert tokenizer.vocab_size == VOCAB_SIZE
    vocab = tokenizer.get_vocab()
    assert len(vocab) == VOCAB_SIZE
    assert sorted(vocab.values()) == list(range(VOCAB_SIZE))


def test_tokenizer_bos_eos(tokenizer):
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    # The tokenizer itself must not insert them: torchtitan adds them.
    assert not tokenizer.hf_adds_bos and not tokenizer.hf_adds_eos
    assert tokenizer.encode("") == []

    text = "Return the sum of the absolute values."
    plain = tokenizer.encode(text)
    assert tokenizer.bos_id not in plain and tokenizer.eos_id not in plain
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids == [tokenizer.bos_id, *plain, tokenizer.eos_id]
    assert ids.count(tokenizer.bos_id) == 1 and ids.count(tokenizer.eos_id) == 1


@pytest.mark.parametrize(
    "text",
    [
        "Return a new list containing all items from the iterable.",
        "def f(x, *, y=2):\n    '''Doc.'''\n\treturn x  **  y\n\n\n",
        "  leading spaces, trailing tabs\t\t",
        "Unicode: café, naïve, Straße, ☃, 日本語, 🙂",
        "",
    ],
)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    # Byte-level BPE is lossless; special tokens are skipped on decode.
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids[1:-1], skip_special_tokens=False) == text


def test_corpus_compresses_well_under_the_tokenizer(tokenizer, corpus):
    sample = corpus[:200]
    n_chars = sum(map(len, sample))
    n_tokens = sum(len(tokenizer.encode(t)) for t in sample)
    assert n_chars / n_tokens > 2.5  # trained on this text: ~3 chars/token


# --------------------------------------------------------------------------
# Corpus + dataset registration
# --------------------------------------------------------------------------


def test_corpus_shape(corpus):
    assert len(corpus) >= 2000
    assert len(set(corpus)) == len(corpus)
    lengths = sorted(map(len, corpus))
    assert lengths[0] >= 200 and lengths[-1] <= 5000
    for t in corpus:
        assert "<|begin_of_text|>" not in t and "<|end_of_text|>" not in t


def test_assets_are_small():
    root = os.path.dirname(data.DEFAULT_TOKENIZER_PATH)
    total = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files
    )
    assert total < 3 * 2**20


def test_register_datasets_is_idempotent():
    data.register_datasets()
    first = text_datasets.DATASETS[data.DATASET_NAME]
    data.register_datasets()
    assert text_datasets.DATASETS[data.DATASET_NAME] is first
    assert first.path == data.DEFAULT_DATASET_PATH
    assert "c4_test" in text_datasets.DATASETS  # we add, never replace the dict


def test_loader_is_in_memory():
    ds = data.load_jsonl_dataset(data.DEFAULT_DATASET_PATH)
    assert ds.column_names == ["text"]
    assert ds.cache_files == []  # nothing on disk, no HF cache to race on


def test_two_ranks_get_disjoint_documents_and_valid_samples(tokenizer, corpus, recording):
    build, seen = recording
    for rank in (0, 1):
        ds = build(
            rank,
            dataset_path=None,
            tokenizer=tokenizer,
            seq_len=SEQ_LEN,
            dp_rank=rank,
            dp_world_size=2,
            infinite=False,
        )
        n = 0
        for n, (inputs, labels) in enumerate(ds, 1):
            x, pos = inputs["input"], inputs["positions"]
            assert x.shape == labels.shape == pos.shape == (SEQ_LEN,)
            assert x.dtype == labels.dtype == torch.long
            assert 0 <= int(x.min()) and int(x.max()) < VOCAB_SIZE
            assert 0 <= int(labels.min()) and int(labels.max()) < VOCAB_SIZE
            if n == 1:
                assert int(x[0]) == tokenizer.bos_id and int(pos[0]) == 0
            # Next-token targets inside a document; a BOS starts the next one.
            same_doc = x[1:] != tokenizer.bos_id
            assert torch.equal(labels[:-1][same_doc], x[1:][same_doc])
            assert (pos[1:][~same_doc] == 0).all()
            assert (labels[:-1][~same_doc] == tokenizer.eos_id).all()
        assert n > 100  # a full epoch of ~0.4M tokens per rank
    r0, r1 = set(seen[0]), set(seen[1])
    assert r0 and r1 and not (r0 & r1)
    assert r0 | r1 == set(corpus)
    assert abs(len(seen[0]) - len(seen[1])) <= 1


def test_dataloader_config_by_name(tokenizer):
    """What a recipe does: ``[dataloader] dataset = "gefen_tiny"``."""
    data.register_datasets()
    cfg = HuggingFaceTextDataLoader.Config(dataset=data.DATASET_NAME)
    dl = HuggingFaceTextDataLoader(
        cfg, dp_world_size=2, dp_rank=1, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=4
    )
    inputs, labels = next(iter(dl))
    assert inputs["input"].shape == inputs["positions"].shape == labels.shape == (4, SEQ_LEN)
    assert int(inputs["input"].max()) < VOCAB_SIZE and int(labels.max()) < VOCAB_SIZE


def _write_jsonl(path, texts, gz: bool) -> None:
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines + "\n")  # a trailing blank line is ignored
    else:
        path.write_text(lines, encoding="utf-8")


@pytest.mark.parametrize("name,gz", [("docs.jsonl", False), ("docs.jsonl.gz", True)])
def test_custom_dataset_path(tmp_path, tokenizer, recording, name, gz):
    texts = [f"Document {i}: " + "spam and eggs. " * (5 + i) for i in range(40)]
    path = tmp_path / name
    _write_jsonl(path, texts, gz)
    build, seen = recording
    ds = build(
        0,
        dataset_path=str(path),
        tokenizer=tokenizer,
        seq_len=64,
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
    )
    samples = list(ds)
    assert seen[0] == texts
    # Each document contributes len(BOS + tokens + EOS) - 1 positions.
    n_positions = sum(len(tokenizer.encode(t)) + 1 for t in texts)
    assert len(samples) == n_positions // 64
    doc0 = tokenizer.encode(texts[0], add_bos=True, add_eos=True)[:-1]
    assert samples[0][0]["input"][: len(doc0)].tolist() == doc0


def test_custom_dataset_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        data.load_jsonl_dataset(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        data.load_jsonl_dataset(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no documents"):
        data.load_jsonl_dataset(str(empty))
