"""Figures for the global-order data path: build time, loader tokens/s against
the training step's, and the memory the loader keeps (``scripts/bench_data_order.py``).

Why these: the loader must never be what a step waits for, and reading must
be memory-mapped, so a corpus far bigger than RAM trains with the memory of a
few batches. The corpus is synthetic (the embedded documents repeated and
perturbed, ``synthesize_corpus``), big enough that a whole-corpus load would
show in the process's anonymous memory.

Memory is read from ``/proc/self/status``: ``RssAnon`` is what the process
itself allocated; the mapped token file shows up as ``RssFile`` (page cache
pages it touched, which the kernel can drop at any time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.tokenizer import HuggingFaceTokenizer

from gefen_titan.data import corpus
from gefen_titan.data.indexed_build import build_indexed_dataset

__all__ = ["LoaderFigures", "bench_loader", "bench_train_step", "in_fresh_process", "main", "memory",
           "synthesize_corpus"]


def memory() -> dict[str, int]:
    """``RssAnon`` and ``RssFile`` of this process, bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def synthesize_corpus(out_dir: str | os.PathLike, factor: int, *, seed: int = 0) -> tuple[Path, int, int]:
    """``factor`` perturbed copies of the embedded corpus as one ``.jsonl``.

    Copy 0 is the corpus itself; copy ``c`` rotates each document's words by a
    seeded amount and heads it with its copy number, so the tokens differ from
    copy to copy. Returns (path, documents, bytes).
    """
    from gefen_titan.data import corpus as data

    texts = data.read_jsonl_texts(data.DEFAULT_DATASET_PATH)
    rng = random.Random(seed)
    path = Path(out_dir) / f"gefen_tiny_x{factor}.jsonl"
    docs = 0
    with open(path, "w", encoding="utf-8") as f:
        for c in range(factor):
            for text in texts:
                if c:
                    words = text.split(" ")
                    k = rng.randrange(len(words))
                    text = f"[copy {c}] " + " ".join(words[k:] + words[:k])
                f.write(json.dumps({"text": text}) + "\n")
                docs += 1
    return path, docs, path.stat().st_size


@dataclass
class LoaderFigures:
    seq_len: int
    local_batch_size: int
    dp_world_size: int
    batches: int
    tokens_per_s: float
    """Tokens this rank's loader yields per second (inputs; labels come with them)."""
    anon_growth: int
    """RssAnon after reading minus before opening, bytes."""
    file_growth: int
    """RssFile growth: pages of the mapped files that were touched."""
    open_seconds: float


def bench_loader(dataset_dir: str, tokenizer: Any, *, seq_len: int, local_batch_size: int, dp_world_size: int,
                 batches: int, dp_rank: int = 0) -> LoaderFigures:
    """Open the global-order loader on ``dataset_dir`` and time ``batches`` batches."""
    from gefen_titan.data.global_loader import GlobalOrderDataLoader

    before = memory()
    begin = time.perf_counter()
    dl = GlobalOrderDataLoader.Config(dataset_path=dataset_dir).build(
        dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=tokenizer, seq_len=seq_len,
        local_batch_size=local_batch_size)
    opened = time.perf_counter() - begin
    it = iter(dl)
    next(it)  # the epoch's permutation is computed here
    begin = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - begin
    after = memory()
    return LoaderFigures(seq_len, local_batch_size, dp_world_size, batches,
                         batches * local_batch_size * seq_len / seconds,
                         after["RssAnon"] - before["RssAnon"], after["RssFile"] - before["RssFile"], opened)


def bench_train_step(recipe: str, overrides: dict[str, Any], steps: int,
                     threads: int = 1) -> tuple[float, int, list[float]]:
    """Tokens/s of the training step (forward, backward, optimizer; data loading
    excluded) of ``recipe`` at one rank, in this process, after one warm-up step.

    ``threads``: torch's intra-op threads; 1 is what torchrun gives each rank
    (``OMP_NUM_THREADS=1``). Returns (tokens/s, tokens per step, step seconds).
    """
    import torch

    torch.set_num_threads(threads)
    from gefen_titan.recipe.build import load_recipe
    from gefen_titan.train import single_process_env

    single_process_env()
    config = load_recipe(recipe, overrides, world_size=1).config
    trainer = config.build()
    try:
        tokens = config.training.global_batch_size * config.training.seq_len
        data_iter = trainer.batch_generator(trainer.dataloader)
        batches = [[next(data_iter) for _ in range(trainer.gradient_accumulation_steps)] for _ in range(steps + 1)]
        times = []
        for i, step_batches in enumerate(batches):
            trainer.step += 1
            begin = time.perf_counter()
            trainer.train_step(iter(step_batches))
            if i:
                times.append(time.perf_counter() - begin)
        return tokens * len(times) / sum(times), tokens, times
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def in_fresh_process(fn, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a new (spawned) interpreter: its memory and
    process group owe nothing to what this process did before."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


# ------------------------------------------------------------------ command line
MB = 1 << 20
RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "llama_gefen_global_order.toml")


def tokenizer():
    return HuggingFaceTokenizer(tokenizer_path=corpus.DEFAULT_TOKENIZER_PATH)


def main() -> None:
    """``scripts/bench_data_order.py``: build, loader and training-step figures on a synthetic big corpus."""
    ap = argparse.ArgumentParser(description="Benchmark the global-order data path on a corpus 100x the embedded one.")
    ap.add_argument("--factor", type=int, default=100, help="copies of the embedded corpus (default 100)")
    ap.add_argument("--workdir", help="where the corpus and datasets go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--train-steps", type=int, default=3, help="timed training steps (after one warm-up)")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes for the big build")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gefen_data_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tok = tokenizer()
        r = build_indexed_dataset([corpus.DEFAULT_DATASET_PATH], tok, work / "tiny", progress=False, overwrite=True)
        print(f"embedded gefen_tiny: {r.num_documents:,} documents, {r.num_tokens:,} tokens, "
              f"built in {r.seconds:.1f} s")

        begin = time.monotonic()
        big, docs, size = synthesize_corpus(work, args.factor)
        print(f"x{args.factor} corpus: {docs:,} documents, {size / MB:,.0f} MB of JSONL "
              f"(written in {time.monotonic() - begin:.0f} s)")
        r = build_indexed_dataset([big], tok, work / f"x{args.factor}", overwrite=True, workers=args.workers)
        bin_mb = os.path.getsize(Path(r.path) / "tokens.bin") / MB
        print(f"x{args.factor} build ({args.workers} worker(s)): {r.num_tokens:,} tokens in {r.seconds:.0f} s "
              f"({r.num_tokens / r.seconds:,.0f} tokens/s); tokens.bin {bin_mb:,.0f} MB")
        big.unlink()

        shapes = [(256, 2, 2, 4000), (2048, 8, 8, 5400)]
        loader = {}
        for seq, local, dp, batches in shapes:
            f = in_fresh_process(bench_loader, r.path, tok, seq_len=seq,
                                            local_batch_size=local, dp_world_size=dp, batches=batches)
            loader[seq] = f
            read = batches * local * seq
            print(f"loader seq {seq} x local {local} (rank 0 of {dp}): {f.tokens_per_s:,.0f} tokens/s; "
                  f"opened in {f.open_seconds * 1e3:.0f} ms; read {read:,} tokens ({100 * read / r.num_tokens:.1f}% "
                  f"of the corpus): RssAnon +{f.anon_growth / MB:.1f} MB, RssFile +{f.file_growth / MB:.1f} MB "
                  f"(tokens.bin {bin_mb:,.0f} MB)")

        tps, tokens, times = in_fresh_process(
            bench_train_step, RECIPE,
            {"checkpoint": {"enable": False}, "metrics": {"log_freq": 1000},
             "dataloader": {"dataset_path": r.path}}, args.train_steps)
        print(f"train step (llama_gefen_global_order.toml, 1 rank, {tokens:,} tokens/step): {tps:,.0f} tokens/s "
              f"(steps {', '.join(f'{t:.2f}' for t in times)} s)")
        print(f"loader / train step: {loader[256].tokens_per_s / tps:,.0f}x at the recipe's shape")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
