"""Build a token dataset (``gefen_titan.data.indexed``) from text files.

    python scripts/build_indexed_dataset.py corpus.jsonl.gz more/ --out data/mycorpus \\
        --tokenizer path/to/hf_assets          # default: the tokenizer shipped here

Inputs are ``.jsonl`` / ``.jsonl.gz`` files (one ``{"text": ...}`` per line,
gzip detected from the magic bytes), ``.txt`` files (one document each), or
directories of them (sorted, recursive). Documents keep the order of the
inputs. Each is encoded as torchtitan's text dataset encodes it
(``tokenizer.encode(text, add_bos=True, add_eos=True)``).

Why resumable: tokenizing a large corpus takes hours, and a build that dies
must neither leave something that looks like a dataset nor start over. The
build writes into ``<out>.partial/``, in chunks of documents; after each chunk
the token and length files are flushed to disk and ``progress.json`` records
how far they are valid. Rerunning the same command truncates the files to that
point, skips the documents already done, and carries on. The finished dataset
appears under ``<out>`` in one directory rename, so ``<out>`` either holds a
complete, checked dataset or does not exist.

``cached_dataset`` builds a single file on first use into a cache directory
(what the data loader does with the embedded ``gefen_tiny`` corpus): the key
is the file's content hash and the tokenizer's identity, so the same inputs
always give the same bytes and a change of either gives a new build.

Beside this module: ``build_inputs`` reads the inputs, ``build_encoder`` runs the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.tools.logging import logger

from gefen_titan.data.build_encoder import Encoder, document_chunks
from gefen_titan.data.build_inputs import describe, iter_documents, source_files
from gefen_titan.data.cache import default_cache_dir, locked
from gefen_titan.data.corpus import DEFAULT_TOKENIZER_PATH
from gefen_titan.data.indexed import (
    BUILD_INFO_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    TOKENS_FILE,
    IndexedDataError,
    IndexedDataset,
    IndexHeader,
    file_sha256,
    offsets_sha256,
    token_dtype,
    tokenizer_identity,
)

__all__ = ["BuildResult", "build_indexed_dataset", "cached_dataset", "iter_documents", "main", "source_files"]

PROGRESS_FILE = "progress.json"
LENGTHS_FILE = "lengths.bin"


@dataclass
class BuildResult:
    path: str
    num_documents: int
    num_tokens: int
    seconds: float
    resumed_at: int = 0
    """Documents already done by an earlier, interrupted run (0: a fresh build)."""
    built: bool = True
    """False when ``path`` already held this build and nothing was done."""


# ---------------------------------------------------------------- build ---


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    try:  # optional: tqdm comes with datasets, but a build runs without it
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:  # pragma: no cover - tqdm comes with datasets
        return None
    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)


def _plan(files: list[Path], tokenizer: Any) -> dict[str, Any]:
    sha, vocab, bos, eos = tokenizer_identity(tokenizer)
    return {
        "format_version": FORMAT_VERSION,
        "sources": describe(files),
        "tokenizer_sha256": sha,
        "tokenizer_path": str(getattr(tokenizer, "tokenizer_path", "") or type(tokenizer).__name__),
        "vocab_size": vocab,
        "bos_id": bos,
        "eos_id": eos,
        "itemsize": token_dtype(vocab).itemsize,
    }


def _same_build(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None if two plans describe the same build, else what differs."""
    for key in ("format_version", "tokenizer_sha256", "vocab_size", "bos_id", "eos_id", "itemsize"):
        if a.get(key) != b.get(key):
            return f"{key} {a.get(key)!r} vs {b.get(key)!r}"
    if [s["path"] for s in a.get("sources", [])] != [s["path"] for s in b.get("sources", [])]:
        return "the list of input files"
    for x, y in zip(a["sources"], b["sources"]):
        if (x["size"], x["mtime_ns"]) != (y["size"], y["mtime_ns"]):
            return f"{x['path']} (size or modification time)"
    return None


def build_indexed_dataset(
    sources: Iterable[str | os.PathLike],
    tokenizer: Any,
    out: str | os.PathLike,
    *,
    chunk_documents: int = 4096,
    progress: bool = True,
    overwrite: bool = False,
    restart: bool = False,
    workers: int = 1,
) -> BuildResult:
    """Tokenize ``sources`` into the dataset directory ``out`` (see the module doc).

    Rerunning after an interruption resumes; rerunning after success returns
    at once (``built=False``). ``overwrite`` replaces a finished dataset built
    from other inputs; ``restart`` discards an unfinished build. ``workers``
    processes tokenize chunks in parallel; the bytes do not depend on it.
    """
    begin = time.monotonic()
    out = Path(out)
    files = source_files(sources)
    plan = _plan(files, tokenizer)
    if chunk_documents < 1 or workers < 1:
        raise ValueError(f"chunk_documents and workers must be >= 1, got {chunk_documents} and {workers}")
    done = _already_built(out, plan, tokenizer, overwrite)
    if done is not None:
        return BuildResult(str(out), done.num_documents, done.num_tokens, time.monotonic() - begin, built=False)

    partial = Path(f"{out}.partial")
    state = _resume_state(partial, plan, restart)
    if state is None:  # an earlier run wrote the index and died before the rename
        return _commit(partial, out, plan, tokenizer, begin, resumed_at=-1)
    dtype = token_dtype(plan["vocab_size"])
    resumed_at = state["documents"]
    _tokenize(files, plan, partial, state, dtype, chunk_documents=chunk_documents, workers=workers,
              progress=progress, tokenizer=tokenizer)
    _write_index(partial, plan, dtype, resumed_at)
    return _commit(partial, out, plan, tokenizer, begin, resumed_at=resumed_at)


def _already_built(out: Path, plan: dict[str, Any], tokenizer: Any, overwrite: bool) -> IndexedDataset | None:
    """The finished dataset at ``out`` if it was built from ``plan``'s inputs (nothing to do); None
    if there is none, or ``overwrite`` lets another build replace it. Anything else there is refused."""
    if (out / INDEX_FILE).is_file():
        info_path = out / BUILD_INFO_FILE
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        diff = _same_build(info.get("plan", {}), plan)
        if diff is None:
            return IndexedDataset.open(out, tokenizer)
        if not overwrite:
            raise IndexedDataError(
                f"{out} already holds a dataset built from other inputs ({diff} differ); pass "
                "--overwrite to replace it, or choose another --out"
            )
    elif out.exists():
        raise IndexedDataError(f"{out} exists and is not a token dataset; choose another --out")
    return None


def _resume_state(partial: Path, plan: dict[str, Any], restart: bool) -> dict[str, int] | None:
    """The documents and tokens an unfinished build of the same inputs in ``partial`` recorded (zero for
    a fresh one, ``partial`` created); None if that build already wrote its index."""
    if partial.exists() and restart:
        shutil.rmtree(partial)
    state = {"documents": 0, "tokens": 0}
    if (partial / PROGRESS_FILE).is_file():
        saved = json.loads((partial / PROGRESS_FILE).read_text())
        diff = _same_build(saved["plan"], plan)
        if diff is not None:
            raise IndexedDataError(
                f"{partial} holds an unfinished build of other inputs ({diff} differ); rerun the "
                "command that started it, or pass --restart to discard it"
            )
        state = {"documents": int(saved["documents"]), "tokens": int(saved["tokens"])}
    elif (partial / INDEX_FILE).is_file():
        return None
    elif partial.exists():
        shutil.rmtree(partial)  # created, nothing recorded yet
    partial.mkdir(parents=True, exist_ok=True)
    return state


def _tokenize(files: list[Path], plan: dict[str, Any], partial: Path, state: dict[str, int], dtype: np.dtype, *,
              chunk_documents: int, workers: int, progress: bool, tokenizer: Any) -> None:
    """Append the documents after ``state``'s to ``partial``'s token and length files, a chunk at a time,
    each chunk synced and then recorded in ``PROGRESS_FILE`` (``state`` is updated)."""
    tok_path, len_path = partial / TOKENS_FILE, partial / LENGTHS_FILE
    _cut_to_progress(((tok_path, state["tokens"] * dtype.itemsize), (len_path, state["documents"] * 8)))
    docs = iter_documents(files)
    bar = _progress_bar(sum(s["size"] for s in plan["sources"]), 0, progress)
    at = 0
    for _ in range(state["documents"]):  # the documents an earlier run did
        _, at = next(docs)
    if bar is not None:
        bar.update(at)
    with Encoder(tokenizer, workers) as encoder, open(tok_path, "ab") as ftok, open(len_path, "ab") as flen:
        for lengths, flat, at_ in encoder.map(document_chunks(docs, chunk_documents)):
            if flat.size and (flat.min() < 0 or flat.max() >= plan["vocab_size"]):
                raise IndexedDataError(
                    f"the tokenizer produced id {int(flat.max())}, outside its vocab size {plan['vocab_size']}"
                )
            ftok.write(flat.astype(dtype).tobytes())
            flen.write(lengths.tobytes())
            for f in (ftok, flen):
                f.flush()
                os.fsync(f.fileno())
            state["documents"] += len(lengths)
            state["tokens"] += int(flat.size)
            _write_json(partial / PROGRESS_FILE, {"plan": plan, **state})
            if bar is not None:
                bar.update(at_ - at)
                bar.set_postfix(docs=state["documents"], tokens=state["tokens"], refresh=False)
            at = at_
    if bar is not None:
        bar.close()
    if state["documents"] == 0:
        raise IndexedDataError(f"{', '.join(map(str, files))}: no documents")


def _cut_to_progress(files: tuple[tuple[Path, int], ...]) -> None:
    """Cut each (file, size) to what ``PROGRESS_FILE`` vouches for: anything after it is from a chunk
    that did not finish."""
    for path, size in files:
        with open(path, "ab") as f:
            if f.tell() < size:
                raise IndexedDataError(f"{path}: shorter than {PROGRESS_FILE} records; pass --restart to start over")
            f.truncate(size)


def _write_index(partial: Path, plan: dict[str, Any], dtype: np.dtype, resumed_at: int) -> None:
    """Finish ``partial``: the index (header last, with the hashes), the build info, and the progress
    and length files removed; the rename is ``_commit``'s."""
    tok_path, len_path = partial / TOKENS_FILE, partial / LENGTHS_FILE
    lengths = np.fromfile(len_path, dtype="<i8")
    offsets = np.zeros(len(lengths) + 1, dtype="<i8")
    np.cumsum(lengths, out=offsets[1:])
    header = IndexHeader(
        version=FORMAT_VERSION, itemsize=dtype.itemsize, num_documents=len(lengths), num_tokens=int(offsets[-1]),
        vocab_size=plan["vocab_size"], bos_id=plan["bos_id"], eos_id=plan["eos_id"],
        tokenizer_sha256=plan["tokenizer_sha256"], offsets_sha256=offsets_sha256(offsets),
        tokens_sha256=file_sha256(tok_path),
    )
    tmp = partial / (INDEX_FILE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.pack())
        f.write(offsets.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / INDEX_FILE)
    _write_json(partial / BUILD_INFO_FILE, {
        "plan": plan,
        "num_documents": header.num_documents,
        "num_tokens": header.num_tokens,
        "built_unix_time": int(time.time()),
        "resumed_at_document": resumed_at,
    })
    (partial / PROGRESS_FILE).unlink()
    len_path.unlink()


def _commit(
    partial: Path, out: Path, plan: dict[str, Any], tokenizer: Any, begin: float, resumed_at: int
) -> BuildResult:
    """Check the finished build and move it into place in one rename.

    ``resumed_at == -1``: an earlier run finished the files but died before
    the rename; they are hashed again before they are trusted.
    """
    ds = IndexedDataset.open(partial, tokenizer)
    if resumed_at == -1:
        ds.verify()
    del ds
    old = Path(f"{out}.old")
    if out.exists():  # --overwrite of a finished dataset
        if old.exists():
            shutil.rmtree(old)
        os.rename(out, old)
    os.rename(partial, out)
    if old.exists():
        shutil.rmtree(old)
    ds = IndexedDataset.open(out, tokenizer)
    return BuildResult(str(out), ds.num_documents, ds.num_tokens, time.monotonic() - begin, max(resumed_at, 0))


# ---------------------------------------------------------------- cache ---


def cached_dataset(
    source: str | os.PathLike, tokenizer: Any, cache_dir: str | os.PathLike | None = None
) -> IndexedDataset:
    """The dataset of one input file, built on first use under ``cache_dir``
    (default: ``gefen_titan.data.cache.default_cache_dir()``)."""
    source = Path(os.path.expanduser(os.fspath(source)))
    if not source.is_file():
        raise IndexedDataError(
            f"{source}: not a file (expected a .jsonl, .jsonl.gz or .txt file, or a token dataset directory)"
        )
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    content = file_sha256(source)[:12]
    name = source.name.split(".")[0]
    out = cache / "indexed" / f"{name}-{content}-{tokenizer_identity(tokenizer)[0][:12]}"
    with locked(out.with_name(out.name + ".lock")):
        if not (out / INDEX_FILE).is_file():
            logger.info(f"Building the token dataset of {source} into {out}")
            result = build_indexed_dataset([source], tokenizer, out, progress=False, overwrite=True)
            logger.info(
                f"Built {result.num_documents} documents, {result.num_tokens} tokens in {result.seconds:.1f} s"
            )
    return IndexedDataset.open(out, tokenizer)


# ------------------------------------------------------------------ CLI ---


def main(argv: list[str] | None = None) -> int:
    doc = (__doc__ or "").split("\n\n")
    ap = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:3]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help=".jsonl, .jsonl.gz or .txt files, or directories of them")
    ap.add_argument("--out", required=True, help="dataset directory to create (set it as [dataloader] dataset_path)")
    ap.add_argument("--tokenizer", default="builtin://tokenizer",
                    help="Hugging Face tokenizer directory, as [job] hf_assets_path (default: the one shipped here)")
    ap.add_argument("--chunk-documents", type=int, default=4096, help="documents per resumable chunk")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes (the output does not depend on it)")
    ap.add_argument("--overwrite", action="store_true", help="replace a finished dataset built from other inputs")
    ap.add_argument("--restart", action="store_true", help="discard an unfinished build instead of resuming it")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    path = DEFAULT_TOKENIZER_PATH if args.tokenizer == "builtin://tokenizer" else args.tokenizer
    try:
        tokenizer = HuggingFaceTokenizer(tokenizer_path=path)
        r = build_indexed_dataset(args.inputs, tokenizer, args.out, chunk_documents=args.chunk_documents,
                                  progress=not args.quiet, overwrite=args.overwrite, restart=args.restart,
                                  workers=args.workers)
    except (IndexedDataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not r.built:
        print(f"{r.path}: already built from these inputs ({r.num_documents} documents, {r.num_tokens} tokens)")
        return 0
    resumed = f", resumed at document {r.resumed_at}" if r.resumed_at else ""
    print(f"{r.path}: {r.num_documents} documents, {r.num_tokens} tokens in {r.seconds:.1f} s{resumed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
