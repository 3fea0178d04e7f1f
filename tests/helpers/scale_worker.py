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

With MOE_DIR (``tests/helpers/scale_moe_job.py``'s output: real state and
format-v3 checkpoints of ``moe_worker``'s model (torchtitan's Qwen3 MoE) at EP 2 x efsdp 2, 4 ranks):

6. moe_checkpoint: per experts count (whole experts on efsdp, and rows cut
   by ``Shard(1)``), the plan of that model and layout on a fake process
   group against the real checkpoint (as 2.), and every rank's planned
   state bytes (Gefen; GefenMuonHybrid's GefenMuon + Gefen) against the
   bytes the real optimizers held, given their periods.
7. moe_muon: the plan's GefenMuon matrices for torchtitan's DeepSeek-V3
   debug model at EP 2 x efsdp 2 (whole experts) and EP 4 x efsdp 4 (rows
   cut) against the real GefenMuonHybrid's sharded step at the same
   layouts, the schedules made from each, one expert weight's chunks, and
   the metadata's extrapolation over its two kinds of layers (dense, MoE).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import scale
from benchmarks.meta import fake_process_group
from gefen_titan import patches
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.recipe import flavors

patches.apply_all()  # CPU / gloo FSDP2
flavors.register_flavors()


def collectives() -> dict:
    from gefen_titan.optim import registry
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
    searched = [c for _, _, unit, c in AgreedBlocking(1).period_candidates(opt.optimizers_of("Gefen")) if unit]
    width = sum(len(c) for c in searched)
    expected = [(op, str(dtype), n)
                for _, op, dtype, n in agreement_collectives(width, len(searched), registry.codebook_families())]
    return {"recorded": recorded, "expected": expected, "width": width}


def checkpoint(step_dir: str, built) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    from gefen_titan.checkpoint.format import schema
    from gefen_titan.checkpoint.io.storage import read_small

    md = FileSystemReader(step_dir).read_metadata()
    prefix = "optimizer."
    name = next(k[len(prefix):] for k in md.state_dict_metadata if k.startswith(prefix)
                and (key := schema.parse_key(k[len(prefix):])) is not None and key.kind == "gefen")
    raw = read_small(step_dir, md, prefix, [], [name])[name]
    record = gefen_records.OptimizerRecord.from_json(raw, schema.parse_key(name).name)
    built = dataclasses.replace(built, gefen_hyper=record.params[0].group)
    periods = {p.fqn: p.period for p in record.params}
    entries = scale.optimizer_entries(built, "Gefen", periods=periods, step=record.global_step)
    chunks = scale.Chunks()
    world = built.mesh.world
    acc = scale.account(entries, world, chunks, keep_assignment=True)
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
    planned = scale.metadata_bytes(entries, world, chunks, step_dir)
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
    for name, entries in (("gefen", scale.optimizer_entries(built, "Gefen")), ("adamw", scale.adamw_entries(built))):
        chunks = scale.Chunks()
        w = built.mesh.world
        full = scale.metadata_estimate(entries, w, chunks, built.checkpoint_id, items=0, exact_items=1)
        layered = scale.metadata_estimate(entries, w, chunks, built.checkpoint_id, items=2, exact_items=1)
        out[name] = {"full": full, "layered": layered}
    return out


def hand(built) -> dict:
    from gefen_titan.optim import registry
    from gefen_titan.optim.kinds.gefen.options import GefenOptions

    p = next(q for q in built.params if q.fqn == "tok_embeddings.weight")
    return {"shape": list(p.shape), "unit": p.unit, "fallback": p.period("fallback"), "finest": p.period("finest"),
            "chunks": scale.Chunks().per_rank(p.shape, p),
            "state": registry.get("Gefen").cost.param_bytes((1024, 256), p.period("fallback"), 4),
            "state_block": registry.get("Gefen").cost.under(GefenOptions(second_moment="block")).param_bytes(
                (1024, 256), p.period("fallback"), 4)}


def planned_and_real(planned: list, optimizers) -> dict:
    """The plan's GefenMuon matrices and schedule beside those the real optimizers built (the caller compares)."""
    from gefen_titan.optim import gefenx as gx
    from gefen_titan.optim.muon import build_schedule

    specs, sched = [], []
    for optim in optimizers.optimizers_of("GefenMuon"):
        mine, schedule = gx.muon_sharded_step(optim).plan()
        specs += mine
        sched += [[list(b.matrices), list(b.owners)] for b in schedule.buckets]
    plan_sched = build_schedule(planned, gx.muon_sharded_step(optimizers.optimizers_of("GefenMuon")[0]).bucket_bytes)
    return {"planned": [dataclasses.astuple(m) for m in planned], "real": [dataclasses.astuple(m) for m in specs],
            "planned_schedule": [[list(b.matrices), list(b.owners)] for b in plan_sched.buckets],
            "real_schedule": sched, "optimizers": len(optimizers.optimizers_of("GefenMuon"))}


def muon(built) -> dict:
    from benchmarks.meta import build_on_meta

    return planned_and_real(scale.muon_specs(built), build_on_meta("recipes/llama_gefen_muon.toml", 2, {}).optimizers)


def moe_checkpoint(base: str) -> dict:
    from benchmarks import scale_moe
    from gefen_titan.optim import hybrid
    from tests.helpers import scale_moe_job

    world = 4
    real = [json.loads((Path(base) / f"r{r}.json").read_text()) for r in range(world)]
    fake_process_group(world)
    out = {}
    for experts in scale_moe_job.EXPERTS:
        tag = f"e{experts}"
        model, container = scale_moe_job.build(experts, world, "gefen")
        step_dir = str(Path(base) / tag)
        built = scale.built_from(tag, scale.mesh_for("ep", world, ep=2), sum(p.numel() for p in model.parameters()),
                                 container, 2, step_dir, [])
        with_muon = dataclasses.replace(built, muon_fqns=frozenset(hybrid.route(model)[0]))
        expert = next(p for p in built.params if len(p.shape) == 3)
        out[tag] = {
            "placements": str(expert.placements), "checkpoint": checkpoint(step_dir, built),
            "gefen_plan": scale.state_bytes(built, "Gefen", periods=real[0][tag]["gefen"]["periods"]),
            "gefen_real": [real[r][tag]["gefen"]["state_bytes"] for r in range(world)],
            "hybrid_plan": scale_moe.state_per_rank(with_muon, "hybrid", periods=real[0][tag]["hybrid"]["periods"]),
            "hybrid_real": [real[r][tag]["hybrid"]["state_bytes"] for r in range(world)],
            "periods_agree": all(real[r][tag][k]["periods"] == real[0][tag][k]["periods"]
                                 for r in range(world) for k in real[0][tag]),
        }
    return out


MOE_BUCKET_MIB = 1  # several buckets at the debug model's size (each ends between grouped weights)


def moe_muon() -> dict:
    from benchmarks import scale_moe
    from benchmarks.meta import build_on_meta

    out = {}
    for world, ep in ((4, 2), (16, 4)):
        mesh = scale.mesh_for("ep", world, ep=ep)
        built = scale.build("DSv3-debug", mesh, max_tp=2)
        planned = scale.muon_specs(built)
        w1 = next(p for p in built.params if p.fqn.endswith("w1_EFD"))
        gefen = scale.optimizer_entries(built, "Gefen")
        row = {"placements": str(w1.placements), "w1": {"shape": list(w1.shape),
                                                         "chunks": scale.Chunks().per_rank(w1.shape, w1)},
               "kinds": scale.layer_kinds(gefen), "extrapolation": extrapolation(built)}
        recipe, flavor = scale.MOE_FLAVORS["DSv3-debug"]
        real = build_on_meta(recipe, world, {"model": {"flavor": flavor}, "parallelism": mesh.parallelism(),
                                             "optimizer": {"name": "GefenMuonHybrid",
                                                           "blocking": {"max_tensor_parallel_degree": 2},
                                                           "muon_bucket_mib": MOE_BUCKET_MIB}}).optimizers
        dist_muon = scale_moe.distmuon_plan(built, planned)
        row.update(distmuon={k: dist_muon[k] for k in ("busiest_experts", "idle_expert_ranks", "max_experts")})
        row.update(planned_and_real(planned, real))
        out[f"{world}x{ep}"] = row
    return out


if __name__ == "__main__":
    result = {"collectives": collectives()}
    built = scale.build("debugmodel", scale.mesh_for("fsdp", 2), max_tp=2, recipe="recipes/llama_gefen.toml")
    result.update(checkpoint=checkpoint(sys.argv[1], built), extrapolation=extrapolation(built), hand=hand(built),
                  muon=muon(built))
    if len(sys.argv) > 2:
        result.update(moe_checkpoint=moe_checkpoint(sys.argv[2]), moe_muon=moe_muon())
    print(json.dumps(result, default=list))
