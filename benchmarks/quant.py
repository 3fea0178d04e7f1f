"""Throughput of the reshard's dequantize / requantize: Triton kernels vs the torch reference.

    python scripts/bench_quant.py                   # sizes by device: CPU 1M..64M, GPU 1M..1B
    python scripts/bench_quant.py --sizes 1M 16M --repeat 5

``measure()`` returns the figures as rows (``scripts/gpu_check.sh`` puts
them in its report).

GB/s counts the bytes each operation must move at least: dequantize reads
1 B of code and writes 4 B of fp32 per element; requantize reads 4 B and
writes 1 B (per-block magnitudes and tables are < 1 % and not counted). The
block mean reads only per-block values, so it is given in elements/s. On a
GPU the kernel's GB/s is also shown as a fraction of the device's HBM
bandwidth.

Kernel figures need CUDA: Triton's CPU interpreter (``TRITON_INTERPRET=1``) is
a correctness tool, thousands of times too slow to time, so on CPU only the
reference is measured.

The inputs mimic a merge (the adapter's slowest path): two source segments
with different periods, codebooks and a phase, requantized at a third period.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from gefen_titan.optim.quant import requant as quant
from gefen_titan.optim.quant.requant import Segment

# Peak HBM bandwidth, GB/s (vendor figures), by device-name substring; first match wins.
HBM_GBPS = [("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
            ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0)]
BYTES = {"dequantize": 5, "requantize": 5}


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "B": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMGB" else s) * mult)


def peak_gbps(device: torch.device) -> tuple[float | None, str]:
    name = torch.cuda.get_device_name(device)
    for key, gbps in HBM_GBPS:
        if key in name:
            return gbps, f"{name}: {gbps:.0f} GB/s (table)"
    try:
        import triton.testing

        gbps = triton.testing.get_dram_gbps(device.index or 0)
        return gbps, f"{name}: {gbps:.0f} GB/s (memory clock x bus width)"
    except Exception:  # unknown part, no driver query
        return None, f"{name}: peak bandwidth unknown"


def inputs(n: int, device: torch.device):
    g = torch.Generator().manual_seed(0)

    def codebook():
        cb = torch.sort(torch.rand(256, generator=g) * 2 - 1).values
        cb[0], cb[-1] = -1.0, 1.0
        return cb.to(device)

    half = (n // 2) // 512 * 512
    specs = [(half, 512, 256), (n - half, 128, 64)]  # (length, period, start): phase 256 into a block
    segs = []
    for length, period, start in specs:
        nb = (start + length) // period + 1
        segs.append(Segment(length, period, start, codebook(), (torch.rand(nb, generator=g) + 0.1).to(device),
                            (torch.rand(nb, generator=g) * 1e-4).to(device)))
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    return codes, segs, codebook()


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of fn() over ``repeat`` runs, after one warm-up (compiles kernels)."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def default_sizes(cuda: bool) -> list[int]:
    return [1 << e for e in (20, 22, 24, 26, 28, 30) if cuda or e <= 26]


def measure(sizes: list[int], device: torch.device, repeat: int = 0, period: int = 256,
            echo: bool = True) -> list[dict]:
    """One row per (size, op): seconds and throughput of the reference and (CUDA) the kernel.

    ``gbps``/``of_peak`` for the byte-bound ops, ``gelps`` for the block mean;
    ``skipped`` where the GPU has too little free memory. ``echo`` prints the
    table as it goes.
    """
    cuda = device.type == "cuda"
    repeat = repeat or (10 if cuda else 2)
    peak, peak_text = peak_gbps(device) if cuda else (None, "")
    say = print if echo else (lambda *a, **k: None)
    say(f"device {device}" + (f" ({peak_text})" if cuda else f", {torch.get_num_threads()} torch threads"))
    if not cuda:
        say("kernel: n/a (needs CUDA; the Triton interpreter is for correctness only, far too slow to time)")
    say(f"{'elements':>9} {'op':>11} {'reference':>16} {'kernel':>16} {'of peak':>8} {'speedup':>8}")
    rows: list[dict] = []
    for n in sizes:
        n -= n % period
        if cuda:
            free, _ = torch.cuda.mem_get_info(device)
            if n * 8 > free * 0.8:  # codes, dense fp32, new codes + headroom for the kernels
                say(f"{n / 2**20:>8.0f}M  skipped: {n * 8 / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free")
                rows.append({"elements": n, "skipped": f"{n * 8 / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free"})
                continue
            ref_fits = n * 40 < free * 0.8  # the reference's int64/fp32 temporaries
        else:
            ref_fits = True
        codes, segs, cb = inputs(n, device)
        with quant.use_backend("reference"):
            dense = quant.dequantize_segments(codes, segs)
        # Each op holds its own inputs: a closure over the loop's names would
        # see whatever they are bound to when called (and none after the del below).
        ops = {
            "dequantize": functools.partial(quant.dequantize_segments, codes, segs),
            "requantize": functools.partial(quant.requantize, dense, cb, period),
            "block mean": functools.partial(quant.block_mean_segments, segs, period),
        }
        for op, fn in ops.items():
            row = {}
            for mode in ("reference", "triton"):
                if (mode == "triton" and not cuda) or (mode == "reference" and not ref_fits):
                    continue
                with quant.use_backend(mode):
                    row[mode] = timed(fn, device, repeat)
            cells, frac = [], ""
            for mode in ("reference", "triton"):
                if mode not in row:
                    cells.append("n/a")
                elif op in BYTES:
                    gbps = BYTES[op] * n / row[mode] / 1e9
                    cells.append(f"{gbps:8.2f} GB/s")
                    if mode == "triton" and peak:
                        frac = f"{gbps / peak:.0%}"
                else:
                    cells.append(f"{n / row[mode] / 1e9:7.2f} Gel/s")
            speedup = f"{row['reference'] / row['triton']:.1f}x" if len(row) == 2 else ""
            say(f"{n / 2**20:>8.0f}M {op:>11} {cells[0]:>16} {cells[1]:>16} {frac:>8} {speedup:>8}", flush=True)
            out = {"elements": n, "op": op, "seconds": row, "peak_gbps": peak, "peak": peak_text}
            if op in BYTES:
                out["gbps"] = {m: BYTES[op] * n / t / 1e9 for m, t in row.items()}
                if "triton" in row and peak:
                    out["of_peak"] = out["gbps"]["triton"] / peak
            else:
                out["gelps"] = {m: n / t / 1e9 for m, t in row.items()}
            rows.append(out)
        del ops, codes, segs, cb, dense  # free the size's tensors before the next, larger one
        if cuda:
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="*", help="element counts, e.g. 1M 16M 1G (default by device)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=0, help="timed runs per point (default: 10 on GPU, 2 on CPU)")
    ap.add_argument("--period", type=int, default=256, help="target block period of the requantize")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sizes = [parse_size(s) for s in args.sizes] if args.sizes else default_sizes(device.type == "cuda")
    measure(sizes, device, args.repeat, args.period)


if __name__ == "__main__":
    main()
