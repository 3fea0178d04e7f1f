"""Real optimizer state and a real checkpoint at an expert-parallel layout, for the scale plan's MoE checks.

One launch of 4 gloo ranks (``processes.run_ranks(4, main, [OUT])``, by
tests/integration/test_scale.py). ``moe_worker``'s small MoE decoder at its
``ep`` layout (torchtitan 0.3.0's sharding: EP 2 x efsdp 2), with 4 experts
per block (whole experts: ``_StridedShard(0)`` on efsdp) and with 2 (rows
cut: ``Shard(1)``), and for each:

* Gefen on every parameter, one step of ``moe_worker``'s fixed gradients,
  its state dict saved under ``OUT/eE`` by our writer (a format-v3
  checkpoint of the optimizer alone);
* GefenMuonHybrid (GefenMuon on the blocks' matrices and the grouped
  experts, Gefen on the rest), one step, not saved.

Each rank writes ``OUT/rRANK.json``: per experts count and optimizer, the
state bytes it holds (``state_bytes``, and per parameter) and every
parameter's block period.
``tests/helpers/scale_worker.py`` plans the same model and layout on a
fake process group and compares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from gefen_titan.checkpoint.io.storage import storage_writer
from gefen_titan.distributed import local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.blocking_options import BlockingOptions
from tests.helpers import moe_worker, worker_jobs
from tests.helpers import small_model as sm

LAYOUT = "ep"  # moe_worker's: EP 2 x efsdp (world / 2)
EXPERTS = (4, 2)
OPTIMIZERS = {"gefen": {}, "hybrid": {"name": "GefenMuonHybrid"}}


def build(experts: int, world: int, optimizer: str):
    model = moe_worker.build_model(LAYOUT, world, experts)
    moe_worker.shard(model, LAYOUT, world)
    return model, sm.optimizer(model, blocking=BlockingOptions(max_tensor_parallel_degree=2), **OPTIMIZERS[optimizer])


def periods(opt) -> dict[str, int]:
    return {fqn: gx.period(optim, p) for optim in opt.optimizers if gx.is_gefenx_optimizer(optim)
            for fqn, p, _ in gx.named_params(optim)}


def param_bytes(opt) -> dict[str, int]:
    """Each parameter's state tensors' bytes on this rank (a failed check names the parameter)."""
    return {fqn: sum(local(v).nbytes for v in optim.state.get(p, {}).values() if isinstance(v, torch.Tensor))
            for optim in opt.optimizers for fqn, p, _ in gx.named_params(optim)}


def job(args: argparse.Namespace, rank: int, world: int) -> None:
    out: dict[str, dict] = {}
    for experts in EXPERTS:
        tag = f"e{experts}"
        out[tag] = {}
        for name in OPTIMIZERS:
            model, opt = build(experts, world, name)
            sched = sm.schedulers(opt, 2)
            moe_worker.step(model, opt, sched, 1)
            if name == "gefen":
                # The optimizer's entries alone, as our manager writes them (storage_writer: v3's raw
                # entries): DCP's dedup balances replicated entries over everything a checkpoint holds,
                # so a full checkpoint's model and train-state items would move their writers.
                path = str(Path(args.out) / tag)
                dcp.save({"optimizer": opt.state_dict()}, storage_writer=storage_writer(path), checkpoint_id=path)
            out[tag][name] = {"state_bytes": opt.state_bytes()[0], "periods": periods(opt),
                              "param_bytes": param_bytes(opt)}
    (Path(args.out) / f"r{rank}.json").write_text(json.dumps(out))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    return ap


def main(argv: list[str]) -> None:
    """``processes.run_ranks``' target: ``--out OUT``."""
    worker_jobs.run(parser(), job, argv)
