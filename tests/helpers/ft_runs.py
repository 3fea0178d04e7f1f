"""Fault-tolerant runs for the tests: a lighthouse, replica groups that can be killed and restarted.

Each replica group is a 2-rank job of ``gefen_titan.train`` (FSDP2 inside the
group: torchtitan averages over the groups in FSDP2's all-reduce hook), its
ranks forked from the session's fork server like ``processes.run_ranks``'
(no fresh imports: a group starts in seconds, not 20-30 s on 2 cores). A
group is killed with SIGKILL on every one of its ranks, as a lost machine
would be. The lighthouse runs in the test process (torchft's
``LighthouseServer``).
"""

from __future__ import annotations

import multiprocessing.connection as mp_connection
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.helpers.processes import PRELOAD, ROOT, free_port

# What every fault-tolerance test run sets on top of its recipe: checkpoints at step 6; sequences of
# 128 tokens (half the recipe's 256: the runs are what the suite's time goes to). FTRun adds
# min_replica_size = its number of groups: a group that loses a peer waits for it (and retries
# its step), so every committed step is every group's and a faulted run can equal an
# uninterrupted one bit for bit.
SETTINGS = ["--checkpoint.interval", "6", "--training.seq_len", "128"]
STEPS = 8
# GefenMuon's runs are shorter: on this CPU (AVX2, no bf16 GEMM) its bf16 Newton-Schulz takes ~90x
# fp32's time, ~13 s a step at the debug model, and its FT run was the suite's slowest test (140 s
# at 8 steps). 5 steps still kill after step 3, heal at step 4 and train one step past the heal.
STEPS_OF = {"recipes/llama_gefen_muon_ft.toml": 5}


def steps_of(recipe: str) -> int:
    """The steps a fault-tolerance test runs ``recipe`` for (and its stored curve holds)."""
    return STEPS_OF.get(recipe, STEPS)
LOSS = re.compile(r"step:\s+(\d+)\s+\x1b\[32mloss:\s+([0-9.]+)")
RECIPE = "recipes/llama_gefen_ft.toml"
SDPA = "gefen_titan.patches.sdpa_attention.sdpa_attention"


def _group_rank(rank: int, world: int, port: int, log: str, env: dict[str, str], argv: list[str]) -> None:
    os.chdir(ROOT)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from gefen_titan.train import main

    main(argv)


@dataclass
class Group:
    """One replica group's ranks (rank 0's log: ``log``)."""

    replica: int
    procs: list
    logs: list[Path]

    def text(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace") if self.logs[rank].exists() else ""

    def losses(self) -> dict[int, float]:
        """Step -> loss, the last logged value of each step (a retried step logs twice)."""
        return {int(s): float(v) for s, v in LOSS.findall(self.text())}

    def wait_for_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while step not in self.losses():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {self.replica} did not reach step {step}:\n{self.text()[-6000:]}")
            time.sleep(0.2)

    def _check_alive(self) -> None:
        failed = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"group {self.replica} rank(s) {failed} failed:\n"
                               + "\n".join(self.text(r)[-6000:] for r in failed))

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()  # SIGKILL: a lost machine says nothing
        for p in self.procs:
            p.join()

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            running = [p for p in self.procs if p.exitcode is None]
            if not running:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {self.replica} still running after {timeout} s:\n{self.text()[-6000:]}")
            mp_connection.wait([p.sentinel for p in running], timeout=2.0)


@dataclass
class FTRun:
    """A lighthouse and the groups of one fault-tolerant run under ``base``."""

    base: Path
    groups: int = 2
    steps: int = STEPS
    recipe: str = RECIPE
    extra: list[str] = field(default_factory=list)
    tamper_heals: int = 0  # ft_hooks: the live ranks' first heals after step 1 are changed after signing
    die_serving_heal: int = 0  # ft_hooks: the run's first heal after step 1 kills its server after these bytes
    env: dict[str, str] = field(default_factory=dict)  # more environment for every rank (a key)
    started: list[Group] = field(default_factory=list)

    def __post_init__(self) -> None:
        from torchft.coordination import LighthouseServer

        # min_replicas = the runs' min_replica_size: a group that lost its peer then waits in the
        # quorum for it, instead of failing quorum after quorum of one (and using up max_retries).
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=self.groups, join_timeout_ms=2000,
                                           quorum_tick_ms=50, heartbeat_timeout_ms=2000)
        (self.base / "dumps").mkdir(parents=True, exist_ok=True)

    @property
    def dumps(self) -> Path:
        return self.base / "dumps"

    def argv(self, replica: int) -> list[str]:
        return ["--job.config", self.recipe, "--job.dump_folder", str(self.base / "out"),
                "--training.steps", str(self.steps), "--fault_tolerance.replica_id", str(replica),
                "--fault_tolerance.group_size", str(self.groups),
                "--fault_tolerance.min_replica_size", str(self.groups),
                # local 2 x 2 ranks x the groups: a group's batches do not depend on the number of groups
                "--training.global_batch_size", str(4 * self.groups),
                "--override.imports", SDPA,
                f'tests.helpers.ft_hooks.dump_ft={{"dir": "{self.dumps}", '
                f'"tamper_heals": {self.tamper_heals}, "die_serving_heal": {self.die_serving_heal}}}',
                *self.extra]

    def start(self, replica: int, attempt: int = 0) -> Group:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        port = free_port()
        env = {"TORCHFT_LIGHTHOUSE": self.lighthouse.address(), "GEFEN_TITAN_CACHE": str(self.base / "cache"),
               "TORCHFT_QUORUM_TIMEOUT_SEC": "120", **self.env}
        logs = [self.base / f"g{replica}-a{attempt}-rank{r}.log" for r in range(2)]
        procs = [ctx.Process(target=_group_rank, args=(r, 2, port, str(logs[r]), env, self.argv(replica)))
                 for r in range(2)]
        for p in procs:
            p.start()
        group = Group(replica, procs, logs)
        self.started.append(group)
        return group

    def close(self) -> None:
        for g in self.started:
            g.kill()
        self.lighthouse.shutdown()


def differences(a: object, b: object, path: str = "") -> list[str]:
    """Where two dumps differ, bit for bit (tensors: dtype, shape and every byte)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"]
        same = torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True
        return [] if same else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} in one only"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def load_dump(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def uninterrupted(base: Path, recipe: str, extra: tuple[str, ...] = (), groups: int = 2,
                  env: dict[str, str] | None = None) -> FTRun:
    """``groups`` groups, start to end: the reference a faulted run is compared with."""
    run = FTRun(base, groups=groups, recipe=recipe, steps=steps_of(recipe), extra=[*SETTINGS, *extra],
                env=env or {})
    try:
        started = [run.start(g) for g in range(groups)]
        for g in started:
            g.wait(400)
    finally:
        run.close()
    return run


DIED = "died-mid-heal"  # ft_hooks' marker: "g<replica>-r<rank> s<step>"


def faulted(base: Path, recipe: str, kill_after: int, extra: tuple[str, ...] = (), tamper_heals: int = 0,
            env: dict[str, str] | None = None, groups: int = 2,
            die_serving_heal: int = 0) -> FTRun:
    """``groups`` groups; the last one SIGKILLed (both ranks: a lost machine) after ``kill_after`` and
    restarted. With ``die_serving_heal`` the group that serves its heal dies part-way through (one
    rank SIGKILLs itself: ft_hooks); the test then kills that group's other rank and restarts it
    too, as a job scheduler would, and it heals like the first."""
    run = FTRun(base, groups=groups, recipe=recipe, steps=steps_of(recipe), extra=[*SETTINGS, *extra],
                tamper_heals=tamper_heals, die_serving_heal=die_serving_heal, env=env or {})
    try:
        live = [run.start(g) for g in range(groups)]
        live[-1].wait_for_step(kill_after, 300)
        live[-1].kill()
        live[-1] = run.start(groups - 1, attempt=1)
        if die_serving_heal:
            marker = run.dumps / DIED
            deadline = time.monotonic() + 300
            while not marker.exists() or not marker.read_text():
                if time.monotonic() > deadline:
                    raise TimeoutError("no live group served a heal:\n" + live[-1].text()[-6000:])
                time.sleep(0.2)
            server = int(marker.read_text().split("-")[0][1:])
            while live[server].procs[int(marker.read_text().split("-r")[1].split()[0])].exitcode is None:
                time.sleep(0.05)  # it killed itself mid-transfer
            live[server].kill()  # its other rank, wherever it waits
            live[server] = run.start(server, attempt=1)
        for g in live:
            g.wait(400)
    finally:
        run.close()
    return run
