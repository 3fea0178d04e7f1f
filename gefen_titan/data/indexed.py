"""A pre-tokenized, memory-mapped token dataset: one flat file of token ids
plus an index of document offsets.

Why: a data order that is the same at every data-parallel size has to address
the corpus as one global token stream (sample ``i`` is tokens ``i * seq_len``
onwards, whatever the number of ranks), and it has to do so without loading
the corpus. Megatron-style indexed datasets do exactly that; this is the same
layout with a header that says what the tokens mean, so a dataset built with
another tokenizer, or a truncated or mismatched file, is refused instead of
read as garbage.

A dataset is a directory (built by ``gefen_titan.data.indexed_build``):

``tokens.bin``
    Every document's token ids, back to back, little-endian ``uint16`` (vocab
    <= 65,536) or ``uint32``. Each document is stored exactly as torchtitan's
    text dataset encodes it: ``tokenizer.encode(text, add_bos=True,
    add_eos=True)``.
``index.idx``
    A fixed header (``HEADER``: magic, format version, token width, counts,
    vocab size, BOS/EOS ids, sha256 of the tokenizer files, of the offsets
    and of ``tokens.bin``), then ``num_documents + 1`` little-endian int64
    token offsets: document ``d`` is ``tokens[offsets[d]:offsets[d + 1]]``.
``build_info.json``
    What it was built from (sources, tokenizer path, times), for people; read
    back only by the builder, to tell whether a rerun asks for the same build.

Opening checks the magic, version, the sizes of both files against the header,
the offsets' end points and hash (8 bytes per document; the tokens are not
read), and, given the run's tokenizer, its identity. ``verify()`` also hashes
the tokens. See ``docs/data_order.md``.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gefen_titan.errors import UserError

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "INDEX_FILE",
    "MAGIC",
    "TOKENS_FILE",
    "IndexHeader",
    "IndexedDataError",
    "IndexedDataset",
    "token_dtype",
    "tokenizer_identity",
]

MAGIC = b"GFNTOKS\x00"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.idx"
BUILD_INFO_FILE = "build_info.json"

# magic, version, itemsize, reserved(3), num_documents, num_tokens, vocab_size,
# bos_id, eos_id, tokenizer_sha256, offsets_sha256, tokens_sha256
HEADER = struct.Struct("<8sIB3xQQQqq32s32s32s")
"""The index header; the int64 offsets start right after it (152 bytes, 8-aligned)."""

_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}

# The files HuggingFaceTokenizer reads to encode (chat templates do not change
# how plain text is encoded, so they are not part of the identity).
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer_config.json")
_PROBE = "gefen-titan tokenizer probe: Hello, world! 1234 \u00e9\u00e8 \t\n def f(x): return x ** 2"


class IndexedDataError(UserError, ValueError):
    """A token dataset that cannot be used as it is (with what to do about it)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id below ``vocab_size``."""
    return _DTYPES[2] if vocab_size <= 1 << 16 else _DTYPES[4]


def tokenizer_identity(tokenizer: Any) -> tuple[str, int, int, int]:
    """``(sha256 hex, vocab size, bos id, eos id)`` of a torchtitan tokenizer.

    For a Hugging Face tokenizer directory (``HuggingFaceTokenizer``, what
    ``hf_assets_path`` names) the hash covers the files it encodes with, by
    name and content; a copy of the directory elsewhere is the same tokenizer.
    Any other tokenizer is identified by how it encodes a fixed probe text.
    BOS/EOS ids are -1 when the tokenizer has none.
    """
    vocab = int(tokenizer.get_vocab_size())
    bos = getattr(tokenizer, "bos_id", None)
    eos = getattr(tokenizer, "eos_id", None)
    bos = -1 if bos is None else int(bos)
    eos = -1 if eos is None else int(eos)
    h = hashlib.sha256()
    path = getattr(tokenizer, "tokenizer_path", None)
    files = [f for f in _TOKENIZER_FILES if path and os.path.isfile(os.path.join(path, f))]
    if files:
        for name in files:
            with open(os.path.join(path, name), "rb") as f:
                blob = f.read()
            h.update(name.encode() + b"\0" + len(blob).to_bytes(8, "little") + blob)
    else:
        ids = tokenizer.encode(_PROBE, add_bos=True, add_eos=True)
        h.update(b"probe\0" + np.asarray(ids, dtype="<i8").tobytes())
    h.update(np.asarray([vocab, bos, eos], dtype="<i8").tobytes())
    return h.hexdigest(), vocab, bos, eos


@dataclass(frozen=True)
class IndexHeader:
    version: int
    itemsize: int
    num_documents: int
    num_tokens: int
    vocab_size: int
    bos_id: int
    eos_id: int
    tokenizer_sha256: str
    offsets_sha256: str
    tokens_sha256: str

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC, self.version, self.itemsize, self.num_documents, self.num_tokens,
            self.vocab_size, self.bos_id, self.eos_id, bytes.fromhex(self.tokenizer_sha256),
            bytes.fromhex(self.offsets_sha256), bytes.fromhex(self.tokens_sha256),
        )

    @classmethod
    def unpack(cls, blob: bytes, where: str) -> IndexHeader:
        if len(blob) < HEADER.size:
            raise IndexedDataError(
                f"{where}: {len(blob)} bytes, shorter than the {HEADER.size}-byte header: the index is "
                "truncated; rebuild the dataset (scripts/build_indexed_dataset.py)"
            )
        magic, version, itemsize, ndocs, ntoks, vocab, bos, eos, tsha, osha, ksha = HEADER.unpack(blob[: HEADER.size])
        if magic != MAGIC:
            raise IndexedDataError(
                f"{where}: not a gefen-titan token index (magic {magic!r}, expected {MAGIC!r}); "
                "build one with scripts/build_indexed_dataset.py"
            )
        if version != FORMAT_VERSION:
            raise IndexedDataError(
                f"{where}: format version {version}, this gefen-titan reads version {FORMAT_VERSION}; "
                "rebuild the dataset with this version's scripts/build_indexed_dataset.py"
            )
        if itemsize not in _DTYPES:
            raise IndexedDataError(f"{where}: token width {itemsize} bytes is not 2 or 4: the index is corrupt")
        return cls(version, itemsize, ndocs, ntoks, vocab, bos, eos, tsha.hex(), osha.hex(), ksha.hex())


def offsets_sha256(offsets: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(offsets, dtype="<i8").tobytes()).hexdigest()


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class IndexedDataset:
    """A token dataset opened for reading: ``tokens`` and ``offsets`` are
    read-only memory maps, so opening costs the header and a hash of the
    offsets, and reading touches only the pages a sample needs."""

    def __init__(self, path: str | os.PathLike, header: IndexHeader, offsets: np.ndarray, tokens: np.ndarray):
        self.path = str(path)
        self.header = header
        self.offsets = offsets
        self.tokens = tokens

    # -- opening ------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike, tokenizer: Any = None) -> IndexedDataset:
        """Open and check the dataset in directory ``path``.

        With ``tokenizer`` (the run's), a dataset built with another tokenizer
        is refused: its ids would mean other tokens.
        """
        path = Path(os.path.expanduser(os.fspath(path)))
        idx, bin_ = path / INDEX_FILE, path / TOKENS_FILE
        if not idx.is_file():
            partial = Path(f"{path}.partial")
            hint = (
                f"; {partial} holds an unfinished build: rerun the build command to finish it"
                if partial.exists() else "; build it with scripts/build_indexed_dataset.py"
            )
            raise IndexedDataError(f"{path}: no token dataset here (no {INDEX_FILE}){hint}")
        with open(idx, "rb") as f:
            header = IndexHeader.unpack(f.read(HEADER.size), str(idx))
        want = HEADER.size + 8 * (header.num_documents + 1)
        have = idx.stat().st_size
        if have != want:
            raise IndexedDataError(
                f"{idx}: {have} bytes, but its header describes {header.num_documents} documents "
                f"({want} bytes): the index is truncated or does not belong to this header; rebuild "
                "the dataset (scripts/build_indexed_dataset.py)"
            )
        if not bin_.is_file():
            raise IndexedDataError(f"{path}: {TOKENS_FILE} is missing; rebuild the dataset")
        want = header.num_tokens * header.itemsize
        have = bin_.stat().st_size
        if have != want:
            raise IndexedDataError(
                f"{bin_}: {have} bytes, but the index describes {header.num_tokens} tokens of "
                f"{header.itemsize} bytes ({want} bytes): the token file is truncated or belongs to "
                "another index; rebuild the dataset"
            )
        offsets = np.memmap(idx, dtype="<i8", mode="r", offset=HEADER.size, shape=(header.num_documents + 1,))
        if int(offsets[0]) != 0 or int(offsets[-1]) != header.num_tokens:
            raise IndexedDataError(
                f"{idx}: the offsets run from {int(offsets[0])} to {int(offsets[-1])}, not 0 to "
                f"{header.num_tokens}: the index is corrupt; rebuild the dataset"
            )
        if offsets_sha256(offsets) != header.offsets_sha256:
            raise IndexedDataError(
                f"{idx}: the document offsets do not match the hash in the header: the index is "
                "corrupt; rebuild the dataset"
            )
        if header.num_tokens:
            tokens = np.memmap(bin_, dtype=_DTYPES[header.itemsize], mode="r", shape=(header.num_tokens,))
        else:
            tokens = np.zeros(0, dtype=_DTYPES[header.itemsize])
        # Plain ndarray views of the maps: the same pages, without np.memmap's
        # per-item overhead (the order bisects the offsets item by item).
        ds = cls(path, header, np.asarray(offsets), np.asarray(tokens))
        if tokenizer is not None:
            ds.check_tokenizer(tokenizer)
        return ds

    def check_tokenizer(self, tokenizer: Any) -> None:
        sha, vocab, bos, eos = tokenizer_identity(tokenizer)
        h = self.header
        if (sha, vocab, bos, eos) != (h.tokenizer_sha256, h.vocab_size, h.bos_id, h.eos_id):
            where = getattr(tokenizer, "tokenizer_path", None) or type(tokenizer).__name__
            raise IndexedDataError(
                f"{self.path} was built with another tokenizer (sha256 {h.tokenizer_sha256[:12]}, vocab "
                f"{h.vocab_size}, BOS {h.bos_id}, EOS {h.eos_id}) than this run's {where} (sha256 "
                f"{sha[:12]}, vocab {vocab}, BOS {bos}, EOS {eos}); its token ids would mean other "
                "tokens. Rebuild it with this tokenizer (scripts/build_indexed_dataset.py --tokenizer "
                "<hf_assets_path>) or point [job] hf_assets_path at the tokenizer it was built with."
            )

    # -- what it holds ------------------------------------------------------

    @property
    def num_documents(self) -> int:
        return self.header.num_documents

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def fingerprint(self) -> str:
        """Identifies the content (header hashes cover tokens, offsets and tokenizer)."""
        return hashlib.sha256(self.header.pack()).hexdigest()[:16]

    def document(self, d: int) -> np.ndarray:
        """Document ``d``'s tokens (BOS ... EOS), as stored."""
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {d} of {self.num_documents}")
        return np.asarray(self.tokens[int(self.offsets[d]) : int(self.offsets[d + 1])])

    def verify(self) -> None:
        """Full check: token hash, increasing offsets, every id below the vocab size."""
        if file_sha256(Path(self.path) / TOKENS_FILE) != self.header.tokens_sha256:
            raise IndexedDataError(
                f"{self.path}/{TOKENS_FILE}: content does not match the hash in the index: the "
                "token file was changed or belongs to another build; rebuild the dataset"
            )
        step = 1 << 22
        for a in range(0, self.num_documents, step):
            if np.any(np.diff(np.asarray(self.offsets[a : a + step + 1])) < 0):
                raise IndexedDataError(f"{self.path}/{INDEX_FILE}: offsets decrease: the index is corrupt")
        for a in range(0, self.num_tokens, step):
            top = int(np.max(self.tokens[a : a + step]))
            if top >= self.header.vocab_size:
                raise IndexedDataError(
                    f"{self.path}/{TOKENS_FILE}: token id {top} >= vocab size {self.header.vocab_size}"
                )
