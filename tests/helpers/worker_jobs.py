"""Several jobs in one launch of the test workers' ranks.

A world size's jobs share one launch: one gloo process group, and the ranks'
start-up paid once. A launch's command line is a sequence of jobs, ``WORKER
ARGS [--then WORKER ARGS ...]`` (WORKER a name of :data:`WORKERS`), each
parsed by that worker's own argparse parser and run in order. Jobs of one
launch share nothing but that group and the files they write: each builds
its meshes, model, optimizer and checkpoint manager afresh from a fixed
seed, and the process groups it registers with :func:`own` (its meshes'
dimensions, torchtitan's async-checkpoint group) are destroyed on every
rank when it ends, after a barrier, so a job that saves a checkpoint is
done with it before a later job of the launch loads it.

A test's plan is a list of :class:`Launch`; :func:`launch_all` starts the
ranks of each as torchrun would, forked from a session-wide server that has
imported the workers once (``processes.run_ranks``: a fresh torchrun
launch costs 15-30 s of imports and rendezvous on 2 cores before any
work). By hand, one worker's jobs (without the WORKER words):
``torchrun --nproc_per_node=N -m tests.helpers.agreed_worker ARGS [--then
ARGS ...]`` (or ``reshard_worker``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tests.helpers import processes

THEN = "--then"
# The workers a launch can mix, by the name that starts each of their jobs.
WORKERS = {"agreed": "tests.helpers.agreed_worker", "reshard": "tests.helpers.reshard_worker",
           "muon": "tests.helpers.muon_worker", "moe": "tests.helpers.moe_worker"}
LAUNCH_TIMEOUT_S = 600

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
        groups = [thing.get_group(d) for d in range(thing.ndim)] if isinstance(thing, DeviceMesh) else [thing]
        _owned.extend(g for g in groups if g is not dist.group.WORLD and g not in _owned)


def _release() -> None:
    gc.collect()  # the job's models and managers, before their groups go
    while _owned:
        dist.destroy_process_group(_owned.pop())


@contextlib.contextmanager
def no_codebook_learning() -> Iterator[None]:
    """Any codebook learning inside the block raises (a load must never
    learn one: seconds of numba per rank); restored on exit, for the next job."""
    # Lazy: gefen-x's and our numba solvers are needed only by the workers'
    # loading jobs, not by the test processes that import this module for Launch.
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


Job = Callable[[argparse.Namespace, int, int], None]


def _run_jobs(jobs: list[tuple[Job, argparse.Namespace, list[str]]]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for i, (job, args, words) in enumerate(jobs):
        if rank == 0:
            print(f"[job {i + 1}/{len(jobs)}] {' '.join(words)}", flush=True)
        begin = time.monotonic()
        job(args, rank, world)
        dist.barrier()
        _release()
        if rank == 0:
            print(f"[job {i + 1}/{len(jobs)}] done in {time.monotonic() - begin:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run(parser: argparse.ArgumentParser, job: Job, argv: Sequence[str] | None = None) -> None:
    """One worker's jobs. Parse every job first (a bad argument fails before any work), then run them."""
    raw = split(sys.argv[1:] if argv is None else argv)
    _run_jobs([(job, parser.parse_args(words), words) for words in raw])


def run_mixed(argv: Sequence[str] | None = None) -> None:
    """Jobs of any of the workers, each ``WORKER ARGS``; parsed first, as in :func:`run`."""
    jobs = []
    for words in split(sys.argv[1:] if argv is None else argv):
        worker = importlib.import_module(WORKERS[words[0]])
        jobs.append((worker.job, worker.parser().parse_args(words[1:]), words))
    _run_jobs(jobs)


# ------------------------------------------------------------ the test side
@dataclass
class Launch:
    """One launch: its world size, its jobs (each ``[WORKER, *args]``)
    and what must be done before it starts (e.g. editing, from checkpoints
    earlier launches saved, the bad checkpoints its jobs try)."""

    world: int
    jobs: list[list[str]]
    before: list[Callable[[], None]] = field(default_factory=list)


def run_job(worker: str, layout: str, tag: str, out: Path, save_step: int, steps: int, *args: str) -> list[str]:
    """One job of a reshard worker (agreed_worker, muon_worker): its layout, tag, outputs and steps."""
    return [worker, "--layout", layout, "--tag", tag, "--out", str(out), "--save-step", str(save_step),
            "--steps", str(steps), *args]


def reshard_jobs(base: Path, job: Callable[..., list[str]], runs: list[tuple],
                 extra: Callable[[str], list[str]] = lambda tag: []) -> tuple[dict[str, tuple[int, list[str]]],
                                                                              Path, Path]:
    """The jobs of ``runs`` rows ``(layout, nproc, tag, ref, loads)`` (tag -> (world size, job): the
    checkpoint it saves under ``base``, those it loads, ``extra(tag)`` more arguments), and the plan's
    folders, made here: (jobs, outputs, bad checkpoints)."""
    out, root = base / "out", base / "bad"
    out.mkdir(parents=True)
    root.mkdir()
    jobs = {}
    for layout, n, tag, ref, loads in runs:
        args = list(extra(tag))
        if ref:
            args += ["--ref", str(base / ref)]
        if loads:
            args += ["--load", ",".join(str(base / c) for c in loads)]
        jobs[tag] = (n, job(layout, tag, out, *args))
    return jobs, out, root


def launched(base: Path, plan: Callable[[Path], list[Launch]]) -> tuple[Path, Path, Path]:
    """Every launch of ``plan(base)`` run (logs under ``base/logs``): (base, outputs, bad checkpoints)."""
    launch_all(plan(base), base / "logs")
    return base, base / "out", base / "bad"


def rank_dumps(out: Path, tag: str) -> list[dict]:
    """What every rank of job ``tag`` wrote under ``out`` (``<tag>_r<rank>.pt``), in rank order."""
    ranks = sorted(out.glob(f"{tag}_r[0-9]*.pt"), key=lambda p: int(p.stem.rsplit("_r", 1)[1]))
    assert ranks, f"no dumps of {tag}"
    # The workers' own files, written by this test session (they hold its plain objects, e.g. GefenMuon's
    # schedules), never a checkpoint: the restricted reading is for what comes from elsewhere.
    return [torch.load(p, weights_only=False) for p in ranks]


def ordered_launches(plan: list[tuple[int, list[str]]], jobs: dict[str, tuple[int, list[str]]],
                     runs: list[tuple], before: dict[str, Callable[[], None]]) -> list[Launch]:
    """The launches of ``plan`` (world size, job tags) over ``jobs`` (tag ->
    (world size, job)), checked: every job is launched once, at its world
    size, after the jobs that save the checkpoints it loads (``runs``:
    ``(layout, nproc, tag, ref, loads)`` rows); ``before``: tag -> what must
    be done before the launch that holds that job."""
    assert set(jobs) == {t for _, tags in plan for t in tags}, "a job that the plan does not launch"
    refs = {tag: ref for _, _, tag, ref, _ in runs}
    loads = {tag: set(loads) for _, _, tag, _, loads in runs}
    saved: set[str] = set()
    launches = []
    for n, tags in plan:
        assert all(jobs[t][0] == n for t in tags), (n, tags)
        for t in tags:
            saved.add(refs.get(t, ""))
            assert loads.get(t, set()) <= saved, f"{t} loads a checkpoint no earlier job saved"
        launches.append(Launch(n, [jobs[t][1] for t in tags], [before[t] for t in tags if t in before]))
    return launches


def launch_all(plan: list[Launch], logs: Path) -> None:
    """Every launch of ``plan`` in order, each after its ``before``; the
    ranks' output goes to ``logs/launchN``."""
    for i, launch in enumerate(plan):
        for prepare in launch.before:
            prepare()
        processes.run_ranks(launch.world, run_mixed, chain(*launch.jobs), logs=logs / f"launch{i}",
                             timeout=LAUNCH_TIMEOUT_S)
