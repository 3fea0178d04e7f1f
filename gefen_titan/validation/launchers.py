"""How a validation run's ranks start: torchrun, or forked from one preloaded server.

A validation trains many short runs (references, reruns, resumes). Started
by torchrun, each rank is a fresh interpreter that imports torch,
torchtitan and gefen_titan again: about 7 s of CPU a rank, a third of a
7-step debug run on a 2-core machine. ``fork`` imports them once, in
multiprocessing's fork server (``gefen_titan.train`` preloaded when the
server starts), and forks each rank from it with the environment torchrun
gives its workers (env:// rendezvous on a free port, ``OMP_NUM_THREADS=1``
where torchrun sets it), so a run computes the same bits either way: the
reference cache does not record the launcher.

As with any multiprocessing start method but fork, the program that
launches (its ``__main__``) must be importable without running itself
(``if __name__ == "__main__":``): the server's children import it.

``fork`` needs a CPU-only torch on Linux: a CUDA build initializes CUDA at
torchtitan's import, and a process forked after that cannot use CUDA. It
is for gloo runs on CPU hosts (tests, CI, a laptop); on GPUs, torchrun.

Torch's CPU kernels (``ATEN_CPU_CAPABILITY``): a run can pin them
(``cpu_kernels``, e.g. ``"avx2"`` on an AVX-512 host). torch reads the
variable when it first dispatches an op, which the server's preload does not
do, so a forked rank that sets it before its first op gets the pinned
kernels; each forked rank checks that it did (``torch_cpu_kernels`` says
what a pin gives on this host), so a future preload that dispatched an op
would fail the run instead of silently running other kernels.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import os
import subprocess
import sys
from multiprocessing import connection
from pathlib import Path

import torch

__all__ = ["CPU_KERNELS_ENV", "ENTRY", "LAUNCHERS", "can_fork", "launch_ranks", "torch_cpu_kernels"]

LAUNCHERS = ("torchrun", "fork")
ENTRY = "gefen_titan.train"
CPU_KERNELS_ENV = "ATEN_CPU_CAPABILITY"  # torch's own variable
_EXPECT_ENV = "GEFEN_TITAN_EXPECT_CPU_KERNELS"  # what a forked rank checks it got


@functools.cache
def torch_cpu_kernels(pin: str | None) -> str:
    """The CPU kernels torch dispatches to in a process started with ``ATEN_CPU_CAPABILITY=pin`` (None: with
    this process's environment), as ``torch.backends.cpu.get_cpu_capability()`` names them. A pin the host
    cannot run gives what torch falls back to (its best below), which is how a caller tells."""
    if pin is None:
        return torch.backends.cpu.get_cpu_capability()
    env = {**os.environ, CPU_KERNELS_ENV: pin}
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=env, capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.strip().splitlines()[-1]


def can_fork() -> str | None:
    """None where ``fork`` can start ranks here, else why not."""
    if sys.platform != "linux":
        return f"the fork launcher needs Linux (this is {sys.platform})"
    if torch.version.cuda is not None or torch.version.hip is not None:
        return "the fork launcher needs a CPU-only torch (a CUDA build initializes CUDA when torchtitan is imported)"
    return None


def launch_ranks(launcher: str, nproc: int, argv: list[str], *, log: Path, env: dict[str, str], port: int) -> int:
    """Run ``gefen_titan.train`` with ``argv`` on ``nproc`` ranks, every rank's output in ``log``; the exit
    status (non-zero when a rank failed: the others are stopped, as torchrun stops them)."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master-port={port}",
               "-m", ENTRY, *argv]
        with open(log, "w") as out:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if launcher != "fork":
        raise ValueError(f"launcher must be one of {list(LAUNCHERS)}, got {launcher!r}")
    if why := can_fork():
        raise RuntimeError(why)
    env = {**env, _EXPECT_ENV: torch_cpu_kernels(env.get(CPU_KERNELS_ENV))}
    log.write_bytes(b"")
    ctx = mp.get_context("forkserver")
    # Read when the server starts (this process's first fork launch); a server
    # already running (started by another caller) imports the entry on each fork.
    ctx.set_forkserver_preload([ENTRY])
    ranks = [ctx.Process(target=_rank, args=(r, nproc, port, str(log), env, argv)) for r in range(nproc)]
    try:
        for p in ranks:
            p.start()
        while running := [p for p in ranks if p.exitcode is None]:
            if any(p.exitcode not in (None, 0) for p in ranks):
                break
            connection.wait([p.sentinel for p in running])
        failed = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
        return failed[0] if failed else 0
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
        for p in ranks:
            if p.pid is not None:
                p.join()


def _rank(rank: int, world: int, port: int, log: str, env: dict[str, str], argv: list[str]) -> None:
    # One log for all ranks, appended line by line as torchrun's pipe would interleave them.
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    expected = os.environ.pop(_EXPECT_ENV)
    if torch.backends.cpu.get_cpu_capability() != expected:  # torch reads ATEN_CPU_CAPABILITY at its first op
        raise RuntimeError(f"forked rank runs torch's {torch.backends.cpu.get_cpu_capability()} CPU kernels, not "
                           f"{expected}: the fork server's preload dispatched an op before the rank set "
                           f"{CPU_KERNELS_ENV}; use the torchrun launcher")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # torchrun's default for several workers is one thread; torch read the
    # variable when the server imported it, so set the thread count itself.
    threads = env.get("OMP_NUM_THREADS") or ("1" if world > 1 else None)
    if threads:
        os.environ["OMP_NUM_THREADS"] = threads
        torch.set_num_threads(int(threads))
    importlib.import_module(ENTRY).main(argv)  # preloaded by the server: no import here
