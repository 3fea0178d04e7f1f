"""A tiny checkpoint as a run saves it, for the load-check tests (tests/unit/test_load_checks.py,
test_metadata_fuzz.py): a two-parameter model with Gefen state (format v3, raw entries), a data
loader's pickled state, torchtitan's train state and a byte entry of its own, saved and resumed by
GefenCheckpointManager in one process, with ``.digests``."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from gefen_titan.checkpoint.io import storage
from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.optim.container import GefenOptimizersContainer
from tests.helpers.untrusted import rewrite_digests

STEP = 1


class Loader:
    """A data loader as torchtitan's saves it: one pickled state per DP rank inside a byte entry."""

    def __init__(self, state=None) -> None:
        self.state = {"epoch": 0, "offset": 12} if state is None else state

    def state_dict(self):
        return {"dp_rank_0": pickle.dumps(self.state)}

    def load_state_dict(self, sd):
        self.state = pickle.loads(sd["dp_rank_0"])  # only after the load's checks passed


class Extra:
    def __init__(self, note=None) -> None:
        self.note = {"seen": 3} if note is None else note

    def state_dict(self):
        return {"note": self.note}

    def load_state_dict(self, sd):
        self.note = sd["note"]


class TrainState:
    """torchtitan's: plain ints, saved as byte entries (``train_state.step``)."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": 64 * self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


class Sched:
    def state_dict(self):
        return {"last_epoch": torch.tensor(STEP)}

    def load_state_dict(self, sd):
        pass


def build(seed: int) -> tuple[nn.Module, GefenOptimizersContainer]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 16, bias=False), nn.LayerNorm(16))
    return net, GefenOptimizersContainer.Config(name="Gefen", lr=1e-2).build(model_parts=[net])


def manager(root: Path, net, opt, loader=None, note=None, step: int = STEP, **config) -> GefenCheckpointManager:
    """The manager of a run at ``step`` (its train state's) saving under ``root/ckpt``."""
    config = {"interval": 1, "keep_latest_k": 0, "last_save_model_only": False, **config}
    cfg = GefenCheckpointManager.Config(enable=True, folder=str(root / "ckpt"), **config)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*initial_load.*")
        return cfg.build(dataloader=loader or Loader(), model_parts=[net], optimizers=opt, lr_schedulers=Sched(),
                         states={"extra": Extra(note), "train_state": TrainState(step)}, sd_adapter=None,
                         base_folder="")


def save(root: Path, loader=None, note=None) -> Path:
    net, opt = build(0)
    net(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    manager(root, net, opt, loader, note).save(curr_step=STEP)
    return root / "ckpt" / f"step-{STEP}"


def resume(root: Path, step: int = STEP, **config) -> tuple[nn.Module, GefenOptimizersContainer]:
    net, opt = build(5)
    assert manager(root, net, opt, **config).load(step=step)
    return net, opt


def edit_metadata(step: Path, change: Callable) -> None:
    """``.metadata`` passed through ``change(metadata)``, ``.digests`` rewritten to match (no key needed)."""
    md = storage.read_metadata(step)
    change(md)
    (step / ".metadata").write_bytes(pickle.dumps(md))
    rewrite_digests(step, md)
