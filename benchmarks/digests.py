"""What one rank reads of ``.digests`` to load its share of a checkpoint saved by many ranks.

    python scripts/bench_digests.py                       # 405B under FSDP at 1,024 ranks (~30 s)
    python scripts/bench_digests.py --world 64 --items-per-rank 2910

A checkpoint saved by W ranks records one digest per stored item: about
(entries per rank) x W rows (at 405B under FSDP over 1,024 ranks, the plan
of ``scripts/plan_scale.py``: 1,773 Gefen v3 entries and 1,137 model
entries per rank, ~3M rows). The benchmark writes a synthetic ``.digests``
of that shape (random offsets, lengths and digests; one data file per rank)
in the current file version (``checkpoint.format.digests``: an index of the data
files, one section of rows per file) and, for comparison, in version 1
(one JSON object holding every row, what a load read before 2026-12-02),
then reads each as a rank of an N -> N load does (``digests.read``, then
the digests of its own file's items) and prints, per version: the bytes
read, the time, and the peak RSS growth (``benchmarks.rss.PeakRSS``).
Every rank of a load reads this, once per load.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import tempfile
import time

from benchmarks.rss import PeakRSS
from gefen_titan.checkpoint.format import digest_format, digests

__all__ = ["main", "synthetic", "measure"]


def synthetic(world: int, per_rank: int, seed: int = 0) -> dict[str, dict[int, tuple[int, str]]]:
    """``items[file][offset] = (length, digest)``: ``per_rank`` items in each of ``world`` data files."""
    rng = random.Random(seed)
    items = {}
    for r in range(world):
        offset, rows = 0, {}
        for i in range(per_rank):  # alternating small (records, codebooks, norms) and large (weights, codes)
            n = rng.randrange(1_000, 400_000_000) if i % 2 else rng.randrange(100, 3_000_000)
            rows[offset] = (n, f"{rng.getrandbits(64):016x}")
            offset += n
        items[f"__{r}_0.distcp"] = rows
    return items


def version_1(size: int, digest: str, items: dict[str, dict[int, tuple[int, str]]]) -> bytes:
    """File version 1's bytes (one JSON object, the digest of the rest on line 1), as it was written."""
    body = json.dumps({"metadata": {"size": size, "digest": digest},
                       "items": {f: [[o, n, d] for o, (n, d) in sorted(v.items())] for f, v in sorted(items.items())}},
                      separators=(",", ":")).encode()
    return f"{digest_format.MAGIC} 1 {digests.ALGORITHM} {digests.hexdigest(body)}\n".encode() + body


def measure(path: str, file: str) -> dict:
    """One rank's read: ``digests.read`` of ``path``, then the digest of every item of ``file``."""
    read: list[int] = []

    class Counting(io.FileIO):
        def read(self, n: int = -1) -> bytes:
            out = super().read(n)
            read.append(len(out))
            return out

    with PeakRSS() as rss:
        t0 = time.perf_counter()
        record = digests.read(lambda: Counting(path), path)
        record.check(file)
        seconds = time.perf_counter() - t0
    return {"bytes_read": sum(read), "seconds": seconds, "peak_rss_growth": rss.growth, "rows": record.count()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=1024, help="ranks that saved the checkpoint (one file each)")
    ap.add_argument("--items-per-rank", type=int, default=1773 + 1137,
                    help="stored items in each rank's file (default: 405B, FSDP, Gefen v3 + model)")
    args = ap.parse_args(argv)
    if args.world < 1 or args.items_per_rank < 1:
        ap.error("--world and --items-per-rank must be >= 1")
    items = synthetic(args.world, args.items_per_rank)
    current = digests.Digests(331_000_000, "0123456789abcdef", items).to_bytes()
    old = version_1(331_000_000, "0123456789abcdef", items)
    del items
    mine = f"__{args.world // 2}_0.distcp"
    print(f".digests of {args.world:,} ranks x {args.items_per_rank:,} items = {args.world * args.items_per_rank:,} "
          f"rows; one rank's N -> N load reads it and its own file's digests\n")
    print("| file version | file MiB | read by one rank MiB | seconds | peak RSS growth MiB |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, raw in ((f"{digest_format.FILE_VERSION} (index + sections; current)", current),
                           ("1 (one JSON object)", old)):
            path = os.path.join(tmp, digests.FILE)
            with open(path, "wb") as f:
                f.write(raw)
            m = measure(path, mine)
            print(f"| {label} | {len(raw) / 2**20:.1f} | {m['bytes_read'] / 2**20:.2f} | {m['seconds']:.3f} "
                  f"| {m['peak_rss_growth'] / 2**20:.0f} |")
