"""The pre-tokenized, memory-mapped token dataset (gefen_titan/data/indexed.py,
gefen_titan/data/indexed_build.py): round trip, determinism, the embedded corpus,
refusals of bad files and of another tokenizer, and resuming a build that was
interrupted."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gefen_titan.data import corpus as data
from gefen_titan.data.indexed import (
    HEADER,
    INDEX_FILE,
    TOKENS_FILE,
    IndexedDataError,
    IndexedDataset,
    tokenizer_identity,
)
from gefen_titan.data.indexed_build import (
    LENGTHS_FILE,
    PROGRESS_FILE,
    build_indexed_dataset,
    cached_dataset,
    main,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def other_tok(tmp_path_factory):
    """A different tokenizer (a 300-id BPE trained here) with the same BOS/EOS layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    folder = tmp_path_factory.mktemp("other_tok")
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(_texts(40), trainer)
    t.save(str(folder / "tokenizer.json"))
    shutil.copy(Path(data.DEFAULT_TOKENIZER_PATH) / "tokenizer_config.json", folder)
    return HuggingFaceTokenizer(tokenizer_path=str(folder))


def _texts(n, start=0):
    return [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 31}" for j in range(i % 23 + 1)) + "."
            for i in range(start, start + n)]


def _jsonl(path, texts, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


@pytest.fixture
def sources(tmp_path):
    """Three kinds of input: jsonl, jsonl.gz (with a blank line), and a directory of .txt."""
    a = _jsonl(tmp_path / "a.jsonl", _texts(30))
    b = _jsonl(tmp_path / "b.jsonl.gz", _texts(25, 30), gz=True)
    d = tmp_path / "txt"
    d.mkdir()
    (d / "2.txt").write_text("the second text file\n")
    (d / "1.txt").write_text("Über the first text file: é, ü, 日本\n")
    texts = _texts(30) + _texts(25, 30) + ["Über the first text file: é, ü, 日本\n", "the second text file\n"]
    return [a, b, d], texts


def _files(path):
    return {n: (Path(path) / n).read_bytes() for n in (TOKENS_FILE, INDEX_FILE)}


def test_round_trip_and_determinism(tmp_path, sources, tok):
    paths, texts = sources
    r = build_indexed_dataset(paths, tok, tmp_path / "ds", chunk_documents=7, progress=False)
    assert r.built and r.num_documents == len(texts) and r.resumed_at == 0
    ds = IndexedDataset.open(tmp_path / "ds", tok)
    assert ds.num_documents == len(texts)
    want = [tok.encode(t, add_bos=True, add_eos=True) for t in texts]
    assert ds.num_tokens == sum(map(len, want))
    for d, w in enumerate(want):
        assert ds.document(d).tolist() == w
    assert ds.tokens.dtype == np.dtype("<u2")  # vocab 2048
    ds.verify()
    # Same inputs, another chunking and folder: the same bytes.
    build_indexed_dataset(paths, tok, tmp_path / "ds2", chunk_documents=1000, progress=False)
    assert _files(tmp_path / "ds") == _files(tmp_path / "ds2")
    # A rerun of a finished build does nothing.
    again = build_indexed_dataset(paths, tok, tmp_path / "ds", progress=False)
    assert not again.built and again.num_tokens == ds.num_tokens
    assert not Path(f"{tmp_path / 'ds'}.partial").exists()


def test_parallel_tokenizing_gives_the_same_bytes(tmp_path, sources, tok):
    paths, _ = sources
    build_indexed_dataset(paths, tok, tmp_path / "one", chunk_documents=6, progress=False)
    r = build_indexed_dataset(paths, tok, tmp_path / "two", chunk_documents=6, progress=False, workers=2)
    assert r.built and _files(tmp_path / "one") == _files(tmp_path / "two")


def test_embedded_corpus_builds_in_seconds_and_deterministically(tmp_path, tok):
    begin = time.monotonic()
    ds = cached_dataset(data.DEFAULT_DATASET_PATH, tok, tmp_path / "cache")
    seconds = time.monotonic() - begin
    print(f"\nembedded gefen_tiny: {ds.num_documents} documents, {ds.num_tokens} tokens, "
          f"built in {seconds:.1f} s ({os.path.getsize(Path(ds.path) / TOKENS_FILE)} bytes of tokens)")
    assert (ds.num_documents, ds.num_tokens) == (2977, 868366)  # gefen_titan/assets/README.md
    assert seconds < 60
    # Second use: opened from the cache, not rebuilt.
    begin = time.monotonic()
    again = cached_dataset(data.DEFAULT_DATASET_PATH, tok, tmp_path / "cache")
    assert again.path == ds.path and time.monotonic() - begin < 2
    other = build_indexed_dataset([data.DEFAULT_DATASET_PATH], tok, tmp_path / "direct", progress=False)
    assert _files(ds.path) == _files(other.path)


# ---------------------------------------------------------------- refusals ---


@pytest.fixture
def built(tmp_path, sources, tok):
    build_indexed_dataset(sources[0], tok, tmp_path / "ds", progress=False)
    return tmp_path / "ds"


def test_truncated_index_is_refused(built):
    idx = built / INDEX_FILE
    blob = idx.read_bytes()
    idx.write_bytes(blob[:-8])
    with pytest.raises(IndexedDataError, match="truncated"):
        IndexedDataset.open(built)
    idx.write_bytes(blob[: HEADER.size - 10])
    with pytest.raises(IndexedDataError, match="truncated"):
        IndexedDataset.open(built)


def test_truncated_token_file_is_refused(built):
    tokens = built / TOKENS_FILE
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(IndexedDataError, match=r"token file is truncated or belongs to another index"):
        IndexedDataset.open(built)


def test_bad_magic_and_version_are_refused(built):
    idx = built / INDEX_FILE
    blob = bytearray(idx.read_bytes())
    idx.write_bytes(b"MMIDIDX\x00" + blob[8:])
    with pytest.raises(IndexedDataError, match="not a gefen-titan token index"):
        IndexedDataset.open(built)
    blob[8:12] = (99).to_bytes(4, "little")
    idx.write_bytes(bytes(blob))
    with pytest.raises(IndexedDataError, match="format version 99"):
        IndexedDataset.open(built)


def test_corrupt_offsets_and_changed_tokens_are_refused(built):
    idx = built / INDEX_FILE
    blob = bytearray(idx.read_bytes())
    blob[HEADER.size + 8 * 5] ^= 1  # one document boundary moved
    idx.write_bytes(bytes(blob))
    with pytest.raises(IndexedDataError, match="do not match the hash"):
        IndexedDataset.open(built)
    blob[HEADER.size + 8 * 5] ^= 1
    idx.write_bytes(bytes(blob))
    tokens = bytearray((built / TOKENS_FILE).read_bytes())
    tokens[10] ^= 1  # same size, other content: only verify() reads the tokens
    (built / TOKENS_FILE).write_bytes(bytes(tokens))
    ds = IndexedDataset.open(built)
    with pytest.raises(IndexedDataError, match="does not match the hash"):
        ds.verify()


def test_another_tokenizer_is_refused(built, tok, other_tok):
    assert tokenizer_identity(tok)[0] != tokenizer_identity(other_tok)[0]
    with pytest.raises(IndexedDataError, match=r"built with another tokenizer .* vocab 2048.* vocab 300"):
        IndexedDataset.open(built, other_tok)
    IndexedDataset.open(built, tok)  # its own is fine


def test_tokenizer_identity_is_the_files_not_their_place(tmp_path, tok):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    copy = tmp_path / "copy"
    shutil.copytree(data.DEFAULT_TOKENIZER_PATH, copy)
    assert tokenizer_identity(HuggingFaceTokenizer(tokenizer_path=str(copy))) == tokenizer_identity(tok)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True  # encodes differently
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert tokenizer_identity(HuggingFaceTokenizer(tokenizer_path=str(copy)))[0] != tokenizer_identity(tok)[0]


def test_not_a_dataset_and_bad_inputs(tmp_path, tok):
    with pytest.raises(IndexedDataError, match="no token dataset here"):
        IndexedDataset.open(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text"}\n')
    with pytest.raises(IndexedDataError, match=r"bad.jsonl:2: expected an object with a string 'text' field"):
        build_indexed_dataset([bad], tok, tmp_path / "out", progress=False)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(IndexedDataError, match="unsupported input"):
        build_indexed_dataset([tmp_path / "x.csv"], tok, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ resume ---


class _Dies:
    """The real tokenizer, which raises after ``calls`` encodes (a killed build)."""

    def __init__(self, tok, calls):
        self._tok, self._left = tok, calls
        self.tokenizer_path = tok.tokenizer_path
        self.bos_id, self.eos_id = tok.bos_id, tok.eos_id

    def get_vocab_size(self):
        return self._tok.get_vocab_size()

    def encode(self, *a, **kw):
        self._left -= 1
        if self._left < 0:
            raise KeyboardInterrupt
        return self._tok.encode(*a, **kw)


def test_interrupted_build_resumes_to_the_same_bytes(tmp_path, sources, tok):
    paths, texts = sources
    out = tmp_path / "ds"
    partial = Path(f"{out}.partial")
    with pytest.raises(KeyboardInterrupt):
        build_indexed_dataset(paths, _Dies(tok, 23), out, chunk_documents=5, progress=False)
    assert not out.exists()  # nothing that looks like a dataset
    with pytest.raises(IndexedDataError, match="unfinished build"):
        IndexedDataset.open(out)
    progress = json.loads((partial / PROGRESS_FILE).read_text())
    assert progress["documents"] == 20  # 4 whole chunks of 5; the 5th died inside
    # A chunk torn mid-write: bytes after what progress.json vouches for.
    with open(partial / TOKENS_FILE, "ab") as f:
        f.write(b"\x07" * 13)
    with open(partial / LENGTHS_FILE, "ab") as f:
        f.write(b"\x01" * 3)
    r = build_indexed_dataset(paths, tok, out, chunk_documents=5, progress=False)
    assert r.resumed_at == 20 and r.num_documents == len(texts)
    assert not partial.exists()
    build_indexed_dataset(paths, tok, tmp_path / "ref", progress=False)
    assert _files(out) == _files(tmp_path / "ref")


def test_resume_refuses_changed_inputs_and_restart_discards(tmp_path, sources, tok):
    paths, _ = sources
    out = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt):
        build_indexed_dataset(paths, _Dies(tok, 12), out, chunk_documents=5, progress=False)
    _jsonl(paths[0], _texts(31))  # the input changed meanwhile
    with pytest.raises(IndexedDataError, match=r"unfinished build of other inputs.*--restart"):
        build_indexed_dataset(paths, tok, out, progress=False)
    r = build_indexed_dataset(paths, tok, out, progress=False, restart=True)
    assert r.resumed_at == 0 and r.num_documents == 31 + 25 + 2
    with pytest.raises(IndexedDataError, match="--overwrite"):
        build_indexed_dataset(paths[:1], tok, out, progress=False)
    assert build_indexed_dataset(paths[:1], tok, out, progress=False, overwrite=True).num_documents == 31


# --------------------------------------------------------------------- CLI ---


def test_command_line(tmp_path, sources, capsys):
    paths, texts = sources
    assert main([*map(str, paths), "--out", str(tmp_path / "ds"), "--chunk-documents", "9"]) == 0
    out, err = capsys.readouterr()
    assert f"{len(texts)} documents" in out
    assert "tokenizing" in err  # the progress bar
    assert main([str(paths[0]), "--out", str(tmp_path / "ds")]) == 1
    assert "--overwrite" in capsys.readouterr().err


def test_build_script_is_a_thin_command_line(tmp_path, sources):
    paths, texts = sources
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_indexed_dataset.py"), *map(str, paths),
                           "--out", str(tmp_path / "ds"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"{len(texts)} documents" in proc.stdout and proc.stderr.count("tokenizing") == 0
