"""The scale plan's checks that need a (fake) process group, in one fresh process.

Run by tests/integration/test_scale.py as ``python -m tests.helpers.scale_worker STEP_DIR``; prints
one JSON line. STEP_DIR is a real format-v3 checkpoint of the debug recipe
saved at 2 gloo ranks (the CPU half of ``scripts/gpu_check.sh``).

1. collectives: real Gefen's first step under a fake process group of 4
   ranks, with every collective recorded, against
   ``blocking.agreement_collectives``.
2. checkpoint: the plan for the debug recipe at FSDP 2, given the periods,
   counters and hyperparameters the checkpoint recorded, against the
   checkpoint's own DCP metadata: entries, chunks, bytes per rank file, the
   rank that wrote each replicated entry, and the size of the metadata
   (its optimizer share).
3. extrapolation: the same plan's metadata built in full vs extrapolated
   over the model's layers.
4. hand: one parameter's chunks and state bytes at FSDP 2.
5. muon: the plan's GefenMuon matrices at FSDP 2 (from the Gefen recipe's
   parameters and the muon recipe's pattern) against the ones the real
   sharded step of ``recipes/llama_gefen_muon.toml`` builds at FSDP 2, and
   the schedules made from each.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys

import torch
import torch.distributed as dist

from benchmarks import scale
from benchmarks.meta import fake_process_group
from gefen_titan import patches
from gefen_titan.recipe import flavors

patches.apply_all()  # CPU / gloo FSDP2
flavors.register_flavors()


def collectives() -> dict:
    from gefen_titan.optim.blocking import AgreedBlocking, agreement_collectives
    from gefen_titan.optim.container import GefenOptimizersContainer

    fake_process_group(4)
    recorded = []

    def all_gather(parts, t, *a, **k):
        recorded.append(("all_gather", str(t.dtype), t.numel()))
        for p in parts:
            p.copy_(t)  # every rank sent the same

    def all_reduce(t, *a, **k):
        recorded.append(("all_reduce", str(t.dtype), t.numel()))

    def broadcast(t, *a, **k):
        recorded.append(("broadcast", str(t.dtype), t.numel()))

    saved = dist.all_gather, dist.all_reduce, dist.broadcast
    dist.all_gather, dist.all_reduce, dist.broadcast = all_gather, all_reduce, broadcast
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 384, bias=False), torch.nn.LayerNorm(384),
                                    torch.nn.Linear(384, 256, bias=False))
        opt = GefenOptimizersContainer.Config(name="Gefen", lr=1e-2).build(model_parts=[model])
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
    finally:
        dist.all_gather, dist.all_reduce, dist.broadcast = saved
    searched = [c for _, _, unit, c in AgreedBlocking(1).period_candidates(opt.gefen_optimizers) if unit]
    width = sum(len(c) for c in searched)
    expected = [(op, str(dtype), n) for _, op, dtype, n in agreement_collectives(width, len(searched))]
    return {"recorded": recorded, "expected": expected, "width": width}


def checkpoint(step_dir: str, built) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    from gefen_titan.checkpoint import schema
    from gefen_titan.checkpoint.storage import read_small

    md = FileSystemReader(step_dir).read_metadata()
    prefix = "optimizer."
    name = next(k[len(prefix):] for k in md.state_dict_metadata if k.startswith(prefix)
                and (key := schema.parse_key(k[len(prefix):])) is not None and key.kind == "optimizer")
    raw = read_small(step_dir, md, prefix, [], [name])[name]
    record = schema.OptimizerRecord.from_json(raw, schema.parse_key(name).name)
    built = dataclasses.replace(built, gefen_hyper=record.params[0].group)
    periods = {p.fqn: p.period for p in record.params}
    entries = scale.gefen_entries(built, "fallback", periods=periods, step=record.global_step)
    chunks = scale.Chunks()
    acc = scale.account(entries, 2, chunks, keep_assignment=True)
    real = {(i.fqn, None if i.offset is None else tuple(i.offset)): info
            for i, info in md.storage_data.items() if i.fqn.startswith(prefix)}
    real_files: dict[str, int] = {}
    for info in real.values():
        real_files[info.relative_path] = real_files.get(info.relative_path, 0) + info.length
    ours = {k: v for k, v in md.state_dict_metadata.items() if k.startswith(prefix)}
    share = Metadata(state_dict_metadata=ours,
                     planner_data={k: v for k, v in md.planner_data.items() if k.startswith(prefix)},
                     storage_data={i: v for i, v in md.storage_data.items() if i.fqn.startswith(prefix)},
                     storage_meta=md.storage_meta, version=md.version)
    planned = scale.metadata_bytes(entries, 2, chunks, step_dir)
    return {
        "keys_plan": sorted(e.key for e in entries), "keys_real": sorted(ours),
        "chunks_plan": acc.chunks, "chunks_real": len(real),
        "files_plan": {f"__{r}_0.distcp": b for r, b in enumerate(acc.bytes_per_rank)}, "files_real": real_files,
        "writers_plan": {k[0]: f"__{r}_0.distcp" for k, r in acc.assignment.items()},
        "writers_real": {k[0]: real[k].relative_path for k in acc.assignment},
        "replicated": len(acc.assignment),
        "metadata_plan": planned["metadata"], "metadata_real": len(pickle.dumps(share)),
    }


def extrapolation(built) -> dict:
    out = {}
    for name, entries in (("gefen", scale.gefen_entries(built, "fallback")), ("adamw", scale.adamw_entries(built))):
        chunks = scale.Chunks()
        w = built.mesh.world
        full = scale.metadata_estimate(entries, w, chunks, built.checkpoint_id, items=0, exact_items=1)
        layered = scale.metadata_estimate(entries, w, chunks, built.checkpoint_id, items=2, exact_items=1)
        out[name] = {"full": full, "layered": layered}
    return out


def hand(built) -> dict:
    p = next(q for q in built.params if q.fqn == "tok_embeddings.weight")
    return {"shape": list(p.shape), "unit": p.unit, "fallback": p.period("fallback"), "finest": p.period("finest"),
            "chunks": scale.Chunks().per_rank(p.shape, p),
            "state": scale.gefen_param_bytes(1024 * 256, p.period("fallback"))}


def muon(built) -> dict:
    from benchmarks.meta import build_on_meta
    from gefen_titan.optim import gefenx as gx
    from gefen_titan.optim.muon import build_schedule

    planned = scale.muon_specs(built)
    real = build_on_meta("recipes/llama_gefen_muon.toml", 2, {}).optimizers
    specs, sched = [], []
    for optim in real.muon_optimizers:
        mine, schedule = gx.sharded_step(optim).plan()
        specs += mine
        sched += [[list(b.matrices), list(b.owners)] for b in schedule.buckets]
    plan_sched = build_schedule(planned, gx.sharded_step(real.muon_optimizers[0]).bucket_bytes)
    return {"planned": [dataclasses.astuple(m) for m in planned], "real": [dataclasses.astuple(m) for m in specs],
            "planned_schedule": [[list(b.matrices), list(b.owners)] for b in plan_sched.buckets],
            "real_schedule": sched, "optimizers": len(real.muon_optimizers)}


if __name__ == "__main__":
    result = {"collectives": collectives()}
    built = scale.build("debugmodel", scale.mesh_for("fsdp", 2), max_tp=2, recipe="recipes/llama_gefen.toml")
    result.update(checkpoint=checkpoint(sys.argv[1], built), extrapolation=extrapolation(built), hand=hand(built),
                  muon=muon(built))
    print(json.dumps(result, default=list))
