"""What a token-dataset build reads (``gefen_titan.data.indexed_build``): its input files and their documents.

Inputs are ``.jsonl`` / ``.jsonl.gz`` files (one ``{"text": ...}`` per line,
gzip detected from the magic bytes), ``.txt`` files (one document each), or
directories of them (sorted, recursive), in the order given. ``describe``
is what a resumed build must find unchanged: sizes and modification times,
since content hashes would cost a full read of a corpus that takes hours to
tokenize.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gefen_titan.data.corpus import GZIP_MAGIC
from gefen_titan.data.indexed import IndexedDataError

__all__ = ["SUFFIXES", "describe", "iter_documents", "source_files"]

SUFFIXES = (".jsonl", ".jsonl.gz", ".txt")


def source_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The input files, directories expanded (sorted, recursive)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES))
            if not found:
                raise IndexedDataError(f"{p}: no {', '.join(SUFFIXES)} files in this directory")
            files += found
        elif p.is_file():
            if not p.name.endswith(SUFFIXES):
                raise IndexedDataError(f"{p}: unsupported input (expected {', '.join(SUFFIXES)} or a directory)")
            files.append(p)
        else:
            raise IndexedDataError(f"{p}: no such file or directory")
    if not files:
        raise IndexedDataError("no input files")
    return files


def describe(files: list[Path]) -> list[dict[str, Any]]:
    """What a resume must find unchanged (content hashes would cost a full read)."""
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def iter_documents(files: list[Path]) -> Iterator[tuple[str, int]]:
    """``(text, bytes of the inputs read so far)`` for every document, in order.

    Errors name the file and line, as ``gefen_titan.data.corpus.read_jsonl_texts``'s do.
    """
    done = 0
    for path in files:
        size = path.stat().st_size
        if path.name.endswith(".txt"):
            yield path.read_text(encoding="utf-8"), done + size
            done += size
            continue
        with open(path, "rb") as raw:
            gzipped = raw.read(2) == GZIP_MAGIC
            raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw) if gzipped else raw
            with stream:
                for lineno, line in enumerate(stream, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise IndexedDataError(f"{path}:{lineno}: not valid JSON ({e})") from None
                    text = record.get("text") if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise IndexedDataError(f"{path}:{lineno}: expected an object with a string 'text' field")
                    yield text, done + raw.tell()
        done += size
