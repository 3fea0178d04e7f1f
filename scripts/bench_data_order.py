#!/usr/bin/env python
"""Benchmark the global-order data path on a corpus 100x the embedded one.

    python scripts/bench_data_order.py                  # x100 corpus in a temp dir, removed afterwards
    python scripts/bench_data_order.py --factor 20 --workdir /tmp/bench --keep

Prints: the time to build the embedded corpus and the big one (tokens/s);
the big corpus's size; the loader's tokens/s per rank at the debug recipe's
shape and at a 2048-token shape, with the anonymous memory it kept (RssAnon:
a whole-corpus load would show here) and the mapped pages it touched
(RssFile); and the training step's tokens/s (recipes/llama_gefen_global_order.toml,
1 rank, data loading excluded), which the loader has to outrun. Loader and
training figures come from fresh processes. The logic is benchmarks.data.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gefen_titan.data import corpus as data

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is a folder of the checkout, not of the wheel
from benchmarks import data as data_bench
from gefen_titan.data.indexed_build import build_indexed_dataset

MB = 1 << 20
RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "llama_gefen_global_order.toml")


def tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        r = build_indexed_dataset([data.DEFAULT_DATASET_PATH], tok, work / "tiny", progress=False, overwrite=True)
        print(f"embedded gefen_tiny: {r.num_documents:,} documents, {r.num_tokens:,} tokens, built in {r.seconds:.1f} s")

        begin = time.monotonic()
        corpus, docs, size = data_bench.synthesize_corpus(work, args.factor)
        print(f"x{args.factor} corpus: {docs:,} documents, {size / MB:,.0f} MB of JSONL "
              f"(written in {time.monotonic() - begin:.0f} s)")
        r = build_indexed_dataset([corpus], tok, work / f"x{args.factor}", overwrite=True, workers=args.workers)
        bin_mb = os.path.getsize(Path(r.path) / "tokens.bin") / MB
        print(f"x{args.factor} build ({args.workers} worker(s)): {r.num_tokens:,} tokens in {r.seconds:.0f} s "
              f"({r.num_tokens / r.seconds:,.0f} tokens/s); tokens.bin {bin_mb:,.0f} MB")
        corpus.unlink()

        shapes = [(256, 2, 2, 4000), (2048, 8, 8, 5400)]
        loader = {}
        for seq, local, dp, batches in shapes:
            f = data_bench.in_fresh_process(data_bench.bench_loader, r.path, tok, seq_len=seq,
                                            local_batch_size=local, dp_world_size=dp, batches=batches)
            loader[seq] = f
            read = batches * local * seq
            print(f"loader seq {seq} x local {local} (rank 0 of {dp}): {f.tokens_per_s:,.0f} tokens/s; "
                  f"opened in {f.open_seconds * 1e3:.0f} ms; read {read:,} tokens ({100 * read / r.num_tokens:.1f}% "
                  f"of the corpus): RssAnon +{f.anon_growth / MB:.1f} MB, RssFile +{f.file_growth / MB:.1f} MB "
                  f"(tokens.bin {bin_mb:,.0f} MB)")

        tps, tokens, times = data_bench.in_fresh_process(
            data_bench.bench_train_step, RECIPE,
            {"checkpoint": {"enable": False}, "metrics": {"log_freq": 1000},
             "dataloader": {"dataset_path": r.path}}, args.train_steps)
        print(f"train step (llama_gefen_global_order.toml, 1 rank, {tokens:,} tokens/step): {tps:,.0f} tokens/s "
              f"(steps {', '.join(f'{t:.2f}' for t in times)} s)")
        print(f"loader / train step: {loader[256].tokens_per_s / tps:,.0f}x at the recipe's shape")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
