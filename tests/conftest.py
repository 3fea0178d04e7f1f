"""Shared, expensive set-up.

Gefen's first step learns block periods and a codebook with ~8 s of
single-threaded numba per process, so tests that need stepped Gefen state share
one stepped optimizer per session instead of stepping their own.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from gefen_titan import data, patches
from worker_jobs import chain

# In-process tests build torchtitan components on CPU: what train.py does first.
patches.apply_all()
data.register_datasets()


class TinyBlock(nn.Module):
    """Big enough that Gefen picks a block period > 1 for the matrices."""

    def __init__(self, dim=64):
        super().__init__()
        self.attn = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 32)

    def forward(self, x):
        return self.out(self.norm(self.attn(x)))


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """Token datasets tokenized on first use (the global-order loader's
    gefen_tiny) go to this session's temp dir, not ~/.cache; runs started
    from tests inherit it."""
    os.environ.setdefault("GEFEN_TITAN_CACHE", str(tmp_path_factory.mktemp("token_cache")))
    return os.environ["GEFEN_TITAN_CACHE"]


@pytest.fixture(scope="session")
def gefen_stepped():
    """(model, container, params before the step) after one Gefen step."""
    from gefen_titan.optimizer import GefenOptimizersContainer

    torch.manual_seed(0)
    model = TinyBlock(dim=256)
    opt = GefenOptimizersContainer.Config(name="Gefen", lr=1e-2).build(model_parts=[model])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    return model, opt, before


# ---------------------------------------------------------------- reshard runs
ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "reshard_worker.py"
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
           f"--master-port={_port[0]}", str(WORKER), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Reference runs at 1..4 ranks (4 saves async), every resume of PAIRS,
    and an HSDP 2 x 2 reference at 4 ranks resumed as plain FSDP at 2 (under
    ``base / "hsdp"``): the jobs of RUN_PLAN."""
    base = tmp_path_factory.mktemp("reshard")
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
    return base, out
