"""Starting the processes of the multi-process tests, so that none outlives its test.

A test that times out (pytest-timeout's ``signal`` method raises in the test's
own thread) or is interrupted must not leave ranks behind: a torchrun worker
whose peers are gone waits in its next collective for as long as gloo lets
it, holding CPU and memory through the rest of the session. Neither
subprocess.run (it SIGKILLs only the process it started) nor torchrun helps
here: torchrun starts every worker in a session of its own, so killing
torchrun, or torchrun's process group, leaves the workers running. So:

* :func:`run` starts the command in a new session and, when the wait ends
  by a timeout or by an exception (pytest-timeout's included), first asks
  the command to stop (SIGTERM to its session: torchrun then stops its
  workers itself) and then SIGKILLs every process that was below it;
* :func:`torchrun` is ``python -m torch.distributed.run --standalone`` through
  :func:`run` (``--standalone``: a free rendezvous port, so runs of the suite
  in several checkouts of one machine do not collide on a fixed one);
* :func:`spawn` is ``torch.multiprocessing`` spawn (or the fork server's,
  ``fork_server=True``) whose ranks are killed when the wait ends early;
* :func:`run_ranks` runs a function on N ranks as torchrun would (the same
  environment), forked from a fork server that has done the heavy imports
  once per session where that is safe: a launch's start-up drops from ~7 s
  of CPU per rank (15-30 s a launch on 2 cores) to well under a second.
"""

from __future__ import annotations

import importlib
import multiprocessing.connection as mp_connection
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.multiprocessing as mp

from gefen_titan.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]

# What the fork server of run_ranks imports before it forks any rank: what
# the test workers and the trainer import (importing a worker also applies
# gefen_titan's patches, as every one of them does first).
PRELOAD = ["gefen_titan.train", "tests.helpers.agreed_worker", "tests.helpers.reshard_worker",
           "tests.helpers.muon_worker"]

# How long a stopped command gets to stop its own children before every
# process below it is killed.
GRACE_S = 10.0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: from /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop(proc: subprocess.Popen) -> None:
    """Stop ``proc`` (started with ``start_new_session=True``) and every process below it."""
    if proc.poll() is not None and not _descendants(proc.pid):
        return
    below = _descendants(proc.pid)  # before they are re-parented away from proc
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal([*below, *_descendants(proc.pid), proc.pid], signal.SIGKILL)
    proc.wait()


def run(cmd: Sequence[str], *, timeout: float, cwd: str | Path = ROOT, capture: bool = True,
        **popen) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=...)`` that leaves no process behind.

    ``capture``: stdout and stderr as text on the result (else wherever
    ``popen`` sends them). A timeout raises ``subprocess.TimeoutExpired``
    after the processes are stopped.
    """
    if capture:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(list(map(str, cmd)), cwd=cwd, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        stop(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def torchrun(nproc: int, *args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=nproc ARGS`` through :func:`run`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return run(cmd, timeout=timeout, **kw)


def spawn(fn: Callable, args: tuple, nprocs: int, *, timeout: float, fork_server: bool = False) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, its ranks killed if
    the wait ends early (a timeout raises ``TimeoutError``; a rank's error
    is raised as spawn raises it).

    ``fork_server``: fork the ranks from the session's fork server, which
    imports :data:`PRELOAD` once (the one :func:`run_ranks` uses), instead of
    each rank importing torch and torchtitan afresh (~3 s a rank). Only
    where :func:`can_fork`; elsewhere spawned.
    """
    start_method = "spawn"
    if fork_server and can_fork():
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts
        start_method = "forkserver"
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{nprocs} ranks of {fn.__name__} still running after {timeout} s")
    except BaseException:
        for p in context.processes:
            if p.is_alive():
                p.kill()
        for p in context.processes:
            p.join()
        raise




def _rank_main(rank: int, world: int, port: int, log: str, cwd: str, target: Callable[[list[str]], None],
               argv: list[str]) -> None:
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # What torchrun gives its workers (env:// rendezvous), and its one thread per rank.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    # The environment variable is read when torch loads, in the fork server: set what it would have set.
    torch.set_num_threads(1)
    target(argv)


def can_fork() -> bool:
    """Whether ranks may be forked from a server that has imported torch and torchtitan.

    Only with a CPU-only torch on Linux: torchtitan asks at import whether
    CUDA is available, which initializes the CUDA driver in a CUDA build,
    and a process forked after that cannot use CUDA.
    """
    return sys.platform == "linux" and torch.version.cuda is None and torch.version.hip is None


def validate_launcher() -> list[str]:
    """The tests' ``gefen-titan validate`` launcher flag: every run's ranks
    forked from the validation's one server (``validation.launchers``, the
    same runs without a fresh import per rank) where :func:`can_fork`, else
    torchrun. The per-rank validation (test_validate_reshard) keeps torchrun."""
    return ["--launcher", "fork"] if can_fork() else []


def run_ranks(world: int, target: Callable[[list[str]], None], argv: list[str], *, logs: Path,
              timeout: float, cwd: str | Path = ROOT) -> str:
    """``target(argv)`` on ``world`` ranks with torchrun's environment (env://
    rendezvous, one thread a rank), in ``cwd``; ``target`` is a module-level
    function (importable by name). Returns the ranks' output, also left in
    ``logs``; raises when a rank fails (the others are stopped, as torchrun
    does) or on a timeout.

    Where :func:`can_fork`, the ranks are forked from multiprocessing's fork
    server, which imports :data:`PRELOAD` once per session (torch, torchtitan,
    gefen_titan, the workers: ~7 s of CPU): a launch then costs no fresh
    imports, each rank a fresh fork of a process that has only imported
    modules (no process group, no thread pool). Elsewhere, a torchrun launch.
    """
    logs.mkdir(parents=True, exist_ok=True)
    if not can_fork():
        proc = torchrun(world, "-m", __spec__.name, f"{target.__module__}:{target.__qualname__}", *argv,
                        timeout=timeout, cwd=cwd)
        out = proc.stdout + proc.stderr
        (logs / "torchrun.log").write_text(out)
        if proc.returncode != 0:
            raise RuntimeError(f"{world} ranks of {target.__qualname__} failed:\n{out[-8000:]}")
        return out
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the session's first call)
    port = free_port()
    ranks = [ctx.Process(target=_rank_main, args=(r, world, port, str(logs / f"rank{r}.log"), str(cwd), target,
                                                   argv))
             for r in range(world)]

    def output() -> str:
        return "\n".join(f"--- rank {r}\n" + (logs / f"rank{r}.log").read_text(errors="replace")
                         for r in range(world) if (logs / f"rank{r}.log").exists())

    deadline = time.monotonic() + timeout
    try:
        for p in ranks:
            p.start()
        while True:
            failed = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"rank(s) {failed} of {world} failed:\n{output()[-8000:]}")
            running = [p for p in ranks if p.exitcode is None]
            if not running:
                return output()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks still running after {timeout} s:\n{output()[-8000:]}")
            mp_connection.wait([p.sentinel for p in running], timeout=min(5.0, max(0.0, deadline - time.monotonic())))
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
        for p in ranks:
            if p.pid is not None:
                p.join()


def _torchrun_rank(argv: list[str]) -> None:
    """One rank of run_ranks' torchrun path: ``MODULE:FUNCTION ARGS...``."""
    module, _, name = argv[0].partition(":")
    getattr(importlib.import_module(module), name)(argv[1:])


if __name__ == "__main__":
    _torchrun_rank(sys.argv[1:])
