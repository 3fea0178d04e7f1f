"""Several jobs in one torchrun launch, for the test workers.

A launch costs 15-30 s (interpreter, torch and torchtitan imports,
rendezvous) before any work, so a worker's command line is a sequence of
jobs, ``JOB [--then JOB ...]``, each parsed by the worker's own argparse
parser and run in order in one gloo process group. Jobs of one launch share
nothing but that group and the files they write: each builds its meshes,
model, optimizer and checkpoint manager afresh from a fixed seed, and the
process groups it registers with :func:`own` (its meshes' dimensions,
torchtitan's async-checkpoint group) are destroyed on every rank when it
ends, after a barrier, so a job that saves a checkpoint is done with it
before a later job of the launch loads it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

THEN = "--then"

_owned: list[dist.ProcessGroup] = []


def chain(*jobs: Sequence[str]) -> list[str]:
    """One command line for ``jobs`` (lists of a worker's arguments)."""
    out: list[str] = []
    for job in jobs:
        out += ([THEN] if out else []) + list(job)
    return out


def split(argv: Sequence[str]) -> list[list[str]]:
    jobs: list[list[str]] = [[]]
    for arg in argv:
        if arg == THEN:
            jobs.append([])
        else:
            jobs[-1].append(arg)
    return jobs


def own(*things) -> None:
    """Destroy these process groups (or a DeviceMesh's) when the job ends.

    The default group is left alone: a 1-D mesh over the whole world uses it.
    """
    for thing in things:
        if thing is None:
            continue
        groups = [thing.get_group(d) for d in range(thing.ndim)] if hasattr(thing, "get_group") else [thing]
        _owned.extend(g for g in groups if g is not dist.group.WORLD and g not in _owned)


def _release() -> None:
    gc.collect()  # the job's models and managers, before their groups go
    while _owned:
        dist.destroy_process_group(_owned.pop())


@contextlib.contextmanager
def no_codebook_learning() -> Iterator[None]:
    """Any codebook learning inside the block raises (a load must never
    learn one: seconds of numba per rank); restored on exit, for the next job."""
    import gefen.quantization

    import gefen_titan.optim.codebook_solver

    def _no_learning(*a, **k):
        raise AssertionError("codebook learning ran during/after a checkpoint load")

    saved = gefen.quantization.exact_dp, gefen_titan.optim.codebook_solver.solve_codebook
    gefen.quantization.exact_dp = gefen_titan.optim.codebook_solver.solve_codebook = _no_learning
    try:
        yield
    finally:
        gefen.quantization.exact_dp, gefen_titan.optim.codebook_solver.solve_codebook = saved


def run(parser: argparse.ArgumentParser, job: Callable[[argparse.Namespace, int, int], None],
        argv: Sequence[str] | None = None) -> None:
    """Parse every job first (a bad argument fails before any work), then run them."""
    raw = split(sys.argv[1:] if argv is None else argv)
    jobs = [parser.parse_args(a) for a in raw]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for i, (args, words) in enumerate(zip(jobs, raw)):
        if rank == 0:
            print(f"[job {i + 1}/{len(jobs)}] {' '.join(words)}", flush=True)
        job(args, rank, world)
        dist.barrier()
        _release()
    dist.barrier()
    dist.destroy_process_group()
