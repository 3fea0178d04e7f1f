"""The save-at-N / load-at-M runs of ``reshard_worker`` (format v1) that
``tests/integration/test_reshard*.py`` check: what runs, in which launches."""

import subprocess
import sys
from pathlib import Path

from tests.helpers.worker_jobs import chain

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.helpers.reshard_worker"
SAVE_STEP, STEPS = 3, 2
PAIRS = [(2, 2), (2, 4), (4, 2), (2, 1), (1, 2), (3, 2)]
# The launches of `runs`, in order: (world size, jobs), a job being ("ref", n)
# (the reference at n, this launch's world size) or ("resume", n) (from n's
# checkpoint), n a world size or "hsdp" (HSDP 2 x 2 at 4 ranks). torchrun's
# start-up is most of a launch's cost, so each world size runs its reference
# and the resumes whose source is saved by then in one launch; the resumes to
# 2 from later references come last.
RUN_PLAN = [
    (2, [("ref", 2), ("resume", 2)]),
    (4, [("ref", 4), ("resume", 2), ("ref", "hsdp")]),
    (1, [("ref", 1), ("resume", 2)]),
    (3, [("ref", 3)]),
    (2, [("resume", 4), ("resume", 1), ("resume", 3), ("resume", "hsdp")]),
]
_port = [29600]


def launch(nproc: int, *args: str) -> None:
    """One torchrun launch of the worker; ``args`` may chain several jobs (``worker_jobs.chain``)."""
    _port[0] += 1
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master-port={_port[0]}", "-m", WORKER, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


def run_all(base: Path) -> Path:
    """Reference runs at 1..4 ranks (4 saves async), every resume of PAIRS,
    and an HSDP 2 x 2 reference at 4 ranks resumed as plain FSDP at 2 (under
    ``base / "hsdp"``): the jobs of RUN_PLAN."""
    out, hsdp = base / "out", base / "hsdp"
    saved, resumed = set(), set()
    for world, plan in RUN_PLAN:
        jobs = []
        for mode, src in plan:
            ckpt = hsdp / "c" if src == "hsdp" else base / f"c{src}"
            extra = []
            if mode == "ref":
                assert src == world or (src == "hsdp" and world == 4), (world, src)
                dst = hsdp / "ref" if src == "hsdp" else out / f"ref{src}"
                extra = ["--hsdp", "2"] if src == "hsdp" else ["--async-mode", "async" if src == 4 else "disabled"]
                saved.add(src)
            else:
                assert src in saved, f"RUN_PLAN resumes from {src} before its reference"
                dst = hsdp / "res" if src == "hsdp" else out / f"{src}to{world}"
                resumed.add((src, world))
            dst.mkdir(parents=True)
            jobs.append(["--mode", mode, "--ckpt", str(ckpt), "--out", str(dst),
                         "--save-step", str(SAVE_STEP), "--steps", str(STEPS), *extra])
        launch(world, *chain(*jobs))
    assert resumed == set(PAIRS) | {("hsdp", 2)}, resumed
    return out
