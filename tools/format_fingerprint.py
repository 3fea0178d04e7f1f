"""A fingerprint of the bytes gefen-titan writes: one hash per kind of checkpoint, to compare two commits.

Command line: ``python scripts/format_fingerprint.py``. It trains a small model two steps and saves it with
``GefenCheckpointManager`` three ways: Gefen under agreed blocking (format v3), Gefen under per-rank blocking
(v1) and ``GefenMuonHybrid`` (Gefen and GefenMuon records, v3). Each line is the kind, the number of entries
in ``.metadata`` and a SHA-256 over every data file's bytes and ``.metadata``'s entries and storage records
(not DCP's ``save_id``, which is random). A refactor that must leave the format alone prints the same lines
before and after: run it in a checkout of each commit (``git worktree add``; for a commit older than this
file, run this file with that checkout as the working folder). Seeded and single-process, so it prints the
same on every run of one machine; torch's kernels differ between CPUs, so compare on one machine.
A developer tool of the checkout, not part of the package.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn as nn

# Run as a file from another checkout: import that checkout's package (the working folder).
sys.path.insert(0, str(Path.cwd()))

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.optim.container import GefenOptimizersContainer

try:
    from gefen_titan.checkpoint.io import storage
except ImportError:  # a commit before checkpoint/'s three wings (issue 51)
    from gefen_titan.checkpoint import storage  # type: ignore[no-redef]

KINDS = (("gefen_v3", "Gefen", False), ("gefen_v1", "Gefen", True), ("hybrid_v3", "GefenMuonHybrid", False))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(16, 32, bias=False)
        self.w2 = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class _Net(nn.Module):
    """Embedding, one block under ``layers`` (GefenMuonHybrid's matrices), a norm and an output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleDict({"0": _Block()})
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.layers["0"](self.emb(x))))


def _optimizer_config(name: str, per_rank: bool) -> GefenOptimizersContainer.Config:
    config = GefenOptimizersContainer.Config
    kwargs: dict = {"name": name, "lr": 1e-2}
    if per_rank:
        if "max_tensor_parallel_degree" in {f.name for f in dataclasses.fields(config)}:  # before [optimizer.blocking]
            kwargs["blocking"] = "per_rank"
        else:
            from gefen_titan.optim.blocking_options import BlockingOptions  # noqa: PLC0415 (absent before it)
            kwargs["blocking"] = BlockingOptions(mode="per_rank")
    return config(**kwargs)


class _State:
    """A component with a state of its own (the train state's step, the LR scheduler's epoch)."""

    def __init__(self, sd: dict) -> None:
        self.sd = sd

    def state_dict(self) -> dict:
        return dict(self.sd)

    def load_state_dict(self, sd: dict) -> None:
        self.sd = dict(sd)


def fingerprint(name: str, per_rank: bool, root: Path) -> tuple[int, str]:
    torch.manual_seed(0)
    net = _Net()
    opt = _optimizer_config(name, per_rank).build(model_parts=[net])
    batches = torch.Generator().manual_seed(1)
    for _ in range(2):
        net(torch.randint(0, 32, (4, 8), generator=batches)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    manager = GefenCheckpointManager.Config(enable=True, folder=str(root), interval=1, keep_latest_k=0,
                                            initial_load_model_only=False,
                                            last_save_model_only=False).build(
        dataloader=None, model_parts=[net], optimizers=opt, lr_schedulers=_State({"last_epoch": 1}),
        states={"train_state": _State({"step": 1})}, sd_adapter=None, base_folder="")
    manager.save(curr_step=1)
    step = root / "step-1"
    digest = hashlib.sha256()
    for f in sorted(step.glob("*.distcp")):
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    metadata = storage.read_metadata(step)  # the project's checked reader (digests, restricted unpickling)
    digest.update(repr(sorted((k, repr(v)) for k, v in metadata.state_dict_metadata.items())).encode())
    digest.update(repr(sorted((repr(k), repr(v)) for k, v in metadata.storage_data.items())).encode())
    return len(metadata.state_dict_metadata), digest.hexdigest()


def main() -> None:
    """One line per kind (``KINDS``): its label, its .metadata entries, its hash."""
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        for label, name, per_rank in KINDS:
            entries, digest = fingerprint(name, per_rank, Path(tmp) / label)
            print(f"{label} {entries} {digest}", flush=True)


if __name__ == "__main__":
    main()
