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
_port = [29600]


def launch(nproc: int, *args: str) -> None:
    _port[0] += 1
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master-port={_port[0]}", str(WORKER), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Reference runs at 1..4 ranks (4 saves async), then every resume."""
    base = tmp_path_factory.mktemp("reshard")
    out = base / "out"
    out.mkdir()
    for n in sorted({n for n, _ in PAIRS}):
        (out / f"ref{n}").mkdir()
        mode = "async" if n == 4 else "disabled"
        launch(n, "--mode", "ref", "--ckpt", str(base / f"c{n}"), "--out", str(out / f"ref{n}"),
               "--save-step", str(SAVE_STEP), "--steps", str(STEPS), "--async-mode", mode)
    for n, m in PAIRS:
        d = out / f"{n}to{m}"
        d.mkdir()
        launch(m, "--mode", "resume", "--ckpt", str(base / f"c{n}"), "--out", str(d),
               "--save-step", str(SAVE_STEP), "--steps", str(STEPS))
    return base, out


