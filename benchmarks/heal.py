"""What a torchft heal costs: bytes moved and time, for Gefen, GefenMuon and AdamW in one run.

For each optimizer: a torchft lighthouse (in this process) and two replica
groups of ``--ranks`` gloo ranks (``torchrun``, FSDP2 inside each group) on
the debug model train ``recipes/llama_gefen_ft.toml`` (GefenMuon:
``llama_gefen_muon_ft.toml``; AdamW: the same recipe with
``--optimizer.name AdamW``) with ``min_replica_size = 2``; group 1 is
SIGKILLed after step ``--kill-after`` and restarted, heals from group 0
and both train to ``--steps``. The restarted group's rank 0 logs what the
heal moved (``gefen_titan.ft.heal``): the model's and the optimizer's bytes
on that rank, the optimizer's bytes per parameter element, how long the
transfer and the load took. The state size the optimizer itself reports
(``Optimizer state on this rank``, the container's ``state_bytes``) is
printed beside it: a heal moves the state as it is, so the two agree up to
a few scalars.

    python scripts/bench_heal.py                 # Gefen, GefenMuon, AdamW: 2 groups x 2 ranks
    python scripts/bench_heal.py --optimizers Gefen --steps 6

Also printed: the wall time from the restart to the healed group's first
committed step (process start, model build and quorum included: what a
lost group costs its peers, who wait for it at ``min_replica_size = 2``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"Gefen": ("recipes/llama_gefen_ft.toml", []),
           "GefenMuon": ("recipes/llama_gefen_muon_ft.toml", []),
           "AdamW": ("recipes/llama_gefen_ft.toml", ["--optimizer.name", "AdamW"])}
HEALED = re.compile(r"Healed from the live replica group at step (\d+): model ([0-9.]+) MiB, optimizer ([0-9.]+) MiB "
                    r"\(([0-9.]+) B/param\) for (\d+) param elements on this rank; received in ([0-9.]+) ms, "
                    r"loaded in ([0-9.]+) m")  # (torchft's own log lines may cut in after it)
STATE = re.compile(r"Optimizer state on this rank: ([0-9.]+) MiB for (\d+) param elements = ([0-9.]+) bytes/param")
STEP = re.compile(r"step:\s+(\d+)\s+\x1b\[32mloss")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill(proc: subprocess.Popen) -> None:
    for pid in _tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class _Group:
    def __init__(self, args, optimizer: str, replica: int, lighthouse: str, out: Path, attempt: int) -> None:
        recipe, extra = RECIPES[optimizer]
        self.log = out / f"{optimizer}-g{replica}-a{attempt}.log"
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1",
               "GEFEN_TITAN_CACHE": str(out / "cache"), "TORCHFT_QUORUM_TIMEOUT_SEC": "300"}
        port = _free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
               f"--master_port={port}", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}",
               "--local-ranks-filter=0", "train.py", "--job.config", recipe, *extra,
               "--job.dump_folder", str(out / optimizer), "--training.steps", str(args.steps),
               "--fault_tolerance.replica_id", str(replica), "--fault_tolerance.min_replica_size", "2",
               "--checkpoint.enable", "false",
               "--training.global_batch_size", str(2 * 2 * args.ranks), "--training.local_batch_size", "2"]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def steps(self) -> list[int]:
        return [int(s) for s in STEP.findall(self.text())]

    def wait_for(self, step: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while step not in self.steps():
            if self.proc.poll() not in (None, 0) or time.monotonic() > deadline:
                raise RuntimeError(f"{self.log.name} did not reach step {step}:\n{self.text()[-4000:]}")
            time.sleep(0.2)
        return time.monotonic() - self.started

    def wait(self, timeout: float) -> None:
        if self.proc.wait(timeout) != 0:
            raise RuntimeError(f"{self.log.name} failed:\n{self.text()[-4000:]}")


def _one(args, optimizer: str, out: Path) -> dict:
    from torchft.coordination import LighthouseServer  # the [ft] extra

    # min_replicas = min_replica_size: group 0 waits in the quorum for the lost group.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=2000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=2000)
    groups: list[_Group] = []
    try:
        groups += [_Group(args, optimizer, 0, lighthouse.address(), out, 0),
                   _Group(args, optimizer, 1, lighthouse.address(), out, 0)]
        groups[1].wait_for(args.kill_after, 600)
        _kill(groups[1].proc)
        groups.append(_Group(args, optimizer, 1, lighthouse.address(), out, 1))
        first = min(s for s in [args.kill_after + 1, args.steps] if s >= args.kill_after + 1)
        back = groups[2].wait_for(first, 600)
        groups[0].wait(600)
        groups[2].wait(600)
    finally:
        for g in groups:
            if g.proc.poll() is None:
                _kill(g.proc)
        lighthouse.shutdown()
    text = groups[2].text()
    heals = HEALED.findall(text)
    if not heals:
        raise RuntimeError(f"{optimizer}: the restarted group logged no heal:\n{text[-4000:]}")
    step, model, opt, bpp, numel, recv, load = heals[-1]
    state = STATE.findall(groups[0].text())
    return {"optimizer": optimizer, "step": int(step), "model_mib": float(model), "opt_mib": float(opt),
            "heal_bpp": float(bpp), "numel": int(numel), "receive_ms": float(recv), "load_ms": float(load),
            "state_bpp": float(state[-1][2]) if state else float("nan"), "restart_to_step_s": back}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizers", default="Gefen,GefenMuon,AdamW")
    ap.add_argument("--ranks", type=int, default=2, help="ranks per replica group (FSDP2 needs 2 or more)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kill-after", type=int, default=3)
    ap.add_argument("--out", default="outputs/bench_heal")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = [_one(args, name.strip(), out) for name in args.optimizers.split(",")]
    print(f"\nheal of 1 of 2 replica groups ({args.ranks} gloo ranks each, debug model), per rank, rank 0:")
    print(f"{'optimizer':10} {'at step':>7} {'model MiB':>9} {'optim MiB':>9} {'heal B/param':>12} "
          f"{'state B/param':>13} {'receive ms':>10} {'load ms':>8} {'restart->step s':>15}")
    for r in rows:
        print(f"{r['optimizer']:10} {r['step']:>7} {r['model_mib']:>9.2f} {r['opt_mib']:>9.2f} {r['heal_bpp']:>12.3f} "
              f"{r['state_bpp']:>13.3f} {r['receive_ms']:>10.1f} {r['load_ms']:>8.1f} {r['restart_to_step_s']:>15.1f}")
    base = next((r for r in rows if r["optimizer"] == "AdamW"), None)
    if base:
        for r in rows:
            if r is not base:
                print(f"{r['optimizer']}: optimizer bytes x{r['opt_mib'] / base['opt_mib']:.3f} of AdamW's, "
                      f"receive time x{r['receive_ms'] / base['receive_ms']:.2f}")
