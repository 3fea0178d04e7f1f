"""GefenMuon's exchange transport: packed point-to-point against ``all_to_all_single``, same bytes, one run.

The sharded step moves, per bucket, each rank's momentum shards to their
owners and the updates back (``optim.muon.exchange``). Two transports can
carry it: one packed buffer per peer posted with ``batch_isend_irecv``
(what the step uses) or one ``all_to_all_single`` over the shard group.
This times both on the same payload: every rank sends every other rank
``--mib`` MiB split evenly (an owner-balanced bucket), median of
``--rounds`` rounds after one warm-up, at each of ``--ranks`` world sizes,
on gloo (CPU processes here; NCCL where the backend is given and GPUs are
visible, one per rank). Received bytes are checked, so a transport that
drops or misorders data fails the run.

    python scripts/bench_muon_exchange.py                      # 2 and 4 ranks, 4 / 32 / 128 MiB per rank
    python scripts/bench_muon_exchange.py --ranks 2 --mib 256 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

__all__ = ["main"]


def _worker(rank: int, world: int, port: int, sizes: list[float], rounds: int, backend: str, out) -> None:
    import torch
    import torch.distributed as dist

    from gefen_titan.optim.muon.exchange import Exchange

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    rows = []
    for mib in sizes:
        n = int(mib * 2**20) // 4 // world * world  # fp32 elements this rank sends in all
        part = n // world
        send = torch.arange(n, dtype=torch.int32, device=device) + rank * n
        times = {"p2p": [], "all_to_all": []}
        for r in range(rounds + 1):
            for how in ("p2p", "all_to_all"):
                dist.barrier()
                t0 = time.perf_counter()
                if how == "p2p":
                    ex = Exchange(device)
                    for peer in range(world):
                        if peer != rank:
                            ex.send(peer, send[peer * part:(peer + 1) * part])
                            ex.recv(peer, (part,), torch.int32)
                    got = ex.start().wait()
                    parts = [got[p][0] if p != rank else send[rank * part:(rank + 1) * part] for p in range(world)]
                else:
                    recv = torch.empty(n, dtype=torch.int32, device=device)
                    dist.all_to_all_single(recv, send)
                    parts = list(recv.split(part))
                if backend == "nccl":
                    torch.cuda.synchronize(device)
                if r:
                    times[how].append(time.perf_counter() - t0)
                for p, t in enumerate(parts):  # peer p's slice for this rank
                    want = torch.arange(part, dtype=torch.int32, device=device) + p * n + rank * part
                    if not torch.equal(t, want):
                        raise SystemExit(f"{how}: rank {rank} received wrong data from rank {p}")
        rows.append({"mib": mib, **{k: statistics.median(v) for k, v in times.items()}})
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        out.put(everyone)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--mib", default="4,32,128", help="MiB each rank sends per exchange (comma-separated)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    args = ap.parse_args(argv)
    try:
        args.ranks = [int(r) for r in args.ranks.split(",") if r]
        args.mib = [float(m) for m in args.mib.split(",") if m]
    except ValueError:
        ap.error("--ranks and --mib take comma-separated numbers")
    if not args.ranks or min(args.ranks) < 2 or not args.mib or min(args.mib) <= 0 or args.rounds < 1:
        ap.error("--ranks >= 2, --mib > 0 and --rounds >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    from gefen_titan.validation.runs import free_port

    args = parse_args(argv)
    print("| ranks | MiB sent per rank | packed p2p s | all_to_all_single s | p2p / all_to_all |")
    print("|---|---|---|---|---|")
    for world in args.ranks:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args.mib, args.rounds, args.backend, out))
                 for port in [free_port()] for r in range(world)]
        for p in procs:
            p.start()
        everyone = out.get()
        for p in procs:
            p.join()
            if p.exitcode:
                sys.exit(f"a rank failed at {world} ranks (exit {p.exitcode})")
        for i, mib in enumerate(args.mib):
            p2p = max(rows[i]["p2p"] for rows in everyone)
            a2a = max(rows[i]["all_to_all"] for rows in everyone)
            print(f"| {world} | {mib:g} | {p2p:.4f} | {a2a:.4f} | x{p2p / a2a:.2f} |", flush=True)
    print(f"\n{args.backend}, the slowest rank's median of {args.rounds} rounds; "
          f"{os.cpu_count()} CPU cores (more ranks than cores are oversubscribed)")
