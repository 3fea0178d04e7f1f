"""The scale plan's mixture-of-experts figures: GefenMuonHybrid's state, and torchtitan main's DistMuon beside it.

``benchmarks.scale`` builds an MoE flavor (``scale.MOE_FLAVORS``: DeepSeek-V3
671B / 16B, Qwen3 30B-A3B, torchtitan 0.3.0's own) as it builds a dense one,
at ``ep`` meshes: FSDP over every rank for the dense parameters, the routed
experts cut by EP ``Shard(0)`` on ``ep`` and FSDP on ``efsdp`` = world / EP
(``Shard(0)``, or ``Shard(1)`` once efsdp x EP exceeds the experts), as
torchtitan's ``parallelize`` does. Its rows then carry what every row carries
(Gefen and AdamW state, checkpoint, metadata, first-step agreement;
GefenMuon's step, whose matrices are those GefenMuonHybrid routes: every
``nn.Linear`` weight in the blocks but the router's gate, and one matrix per
routed expert of each grouped weight) and, from here:

* **GefenMuonHybrid's state per rank**: GefenMuon on its matrices (1 B per
  element of codes, an fp32 magnitude per block, NorMuon's fp32 per row of
  the shard) and Gefen on the rest, a codebook each, by each kind's registry
  entry (``cost``: ``optim.state_cost.StateCost``); periods as the plan's
  Gefen rows take them (the row unit).
* **DistMuon** (torchtitan main, ``torchtitan/distributed/flex_shard/
  dist_muon.py``; not in 0.3.0, CUDA only; modelled from its design, never
  run): fp32 momentum like the parameter (4 B per element) and AdamW for the
  rest (torchtitan's Muon setups leave embeddings, head, norms and the
  router to Adam); a 2-D matrix is ``Owned``: gathered whole to one rank of
  its copy, owners balanced by Newton-Schulz cost over the 2-D matrices
  alone (here all in one bucket, its best case); a batch-first 3-D weight
  is computed ``Shard(0)``: its whole experts split by dim 0 over the ranks
  that hold the weight (EP's cut kept, efsdp's redistributed to dim 0), so
  each rank orthogonalizes the experts of its chunk, the same ranks in
  every layer, and a rank whose chunk is empty (efsdp x EP > experts) none.
  It applies where every 2-D matrix is sharded over one mesh dim (its owned
  transport is single-axis), which every ``ep`` mesh here is.

The busiest owner of each is the rank with the most Newton-Schulz FLOPs in a
step (``schedule.ns_flops``, the same per matrix for both).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import torch

from benchmarks.scale_parts import Built, Chunks, Param, fmt_bytes, fmt_flops, is_muon, muon_table

__all__ = ["MOE_FIGURES", "distmuon_plan", "moe_figures", "moe_table", "rank_local_placeholders", "report_moe",
           "state_per_rank"]

DISTMUON_ELEMENT_BYTES = 4  # DistMuon's momentum_buffer: zeros_like(grad), the fp32 parameter's dtype


def rank_local_placeholders(params: list[Param], world: int) -> int:
    """Bytes gefen-x 0.5.0 keeps on every rank for its own rank-local checkpoint schema (which
    gefen-titan never writes): one uint8 per rank of the job in the first parameter's state, when
    every DTensor parameter of the optimizer lies on one 1-D mesh over all the ranks (``gefen.Gefen.
    _install_rank_local_checkpoint_schema``). GefenMuonHybrid's backup (embeddings, head, norms,
    router) is such an optimizer; an all-Gefen MoE optimizer (experts on their own mesh) is not."""
    meshes = {(p.mesh_shape, tuple(p.tensor.device_mesh.mesh.flatten().tolist())) for p in params
              if p.tensor is not None and hasattr(p.tensor, "device_mesh")}
    if len(meshes) != 1:
        return 0
    (shape, ranks), = meshes
    return world if shape == (world,) and sorted(ranks) == list(range(world)) else 0


def state_per_rank(built: Built, optimizer: str, periods: dict[str, int] | None = None) -> list[int]:
    """Per rank, the state of ``optimizer``: "hybrid" (GefenMuon on the plan's Muon matrices, Gefen on
    the rest: their codebooks and ``rank_local_placeholders`` included) or "distmuon" (DistMuon's fp32
    momentum on them, AdamW on the rest)."""
    if optimizer not in ("hybrid", "distmuon"):
        raise ValueError(f"unknown optimizer {optimizer!r}")
    from gefen_titan.optim import registry

    gefen, gefen_muon, adamw = (registry.get(name).cost for name in ("Gefen", "GefenMuon", "AdamW"))
    gefen = gefen.under(built.gefen_options)  # the recipe's second moment (None: the default's)
    chunks = Chunks()
    w = built.mesh.world
    out = [0] * w
    if optimizer == "hybrid":
        muon = [p for p in built.params if is_muon(built, p)]
        rest = [p for p in built.params if not is_muon(built, p)]
        out = [sum(cost.optimizer_bytes + rank_local_placeholders(ps, w)
                   for cost, ps in ((gefen_muon, muon), (gefen, rest)) if ps)] * w
    for p in built.params:
        muon = is_muon(built, p)
        period = (periods or {}).get(p.fqn) or p.period("fallback")
        elem = torch._utils._element_size(p.dtype)
        for r, (sizes, _) in enumerate(chunks.per_rank(p.shape, p)):
            if optimizer == "distmuon":  # momentum; or AdamW's state
                out[r] += math.prod(sizes) * DISTMUON_ELEMENT_BYTES if muon else adamw.param_bytes(sizes, period, elem)
            else:
                out[r] += (gefen_muon if muon else gefen).param_bytes(sizes, period, elem)
    return out


def distmuon_plan(built: Built, specs: list) -> dict[str, Any]:
    """DistMuon's Newton-Schulz per rank at this mesh (see the module doc): the busiest rank's FLOPs,
    its experts and the ranks that orthogonalize none, or why it does not apply."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from gefen_titan.distributed.layout import shard_box
    from gefen_titan.optim.muon.schedule import ns_flops

    world = built.mesh.world
    experts = [0] * world  # expert matrices each rank orthogonalizes
    expert_flops = [0] * world
    matrices = []  # (cost, fqn, members) of the 2-D matrices
    by_fqn = {s.fqn: s for s in specs}
    boxes: dict[tuple, list[int]] = {}
    for p in built.params:
        if not is_muon(built, p):
            continue
        sharding = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
        if len(p.shape) == 2:
            if len(sharding) > 1:
                return {"applies": False, "why": f"{p.fqn} is sharded over {len(sharding)} mesh dims (DistMuon's "
                                                 "owned transport is single-axis)"}
            s = by_fqn[p.fqn]
            matrices.append((s.cost, s.fqn, s.members))
            continue
        key = (p.shape, str(p.placements), p.mesh_shape, id(p.coords))
        if key not in boxes:
            compute = []
            for d, pl in enumerate(p.placements):
                later = math.prod(p.mesh_shape[j] for j in sharding if j > d)
                compute.append(Replicate() if pl.is_replicate() else
                               _StridedShard(0, split_factor=later) if later > 1 else Shard(0))
            boxes[key] = [shard_box(p.shape, p.mesh_shape, compute, c).sizes[0] for c in p.coords]
        cost = ns_flops(p.shape[-2:], built.muon_ns_steps)
        for r, n in enumerate(boxes[key]):
            experts[r] += n
            expert_flops[r] += n * cost
    heaps: dict[tuple, list] = {}
    two_d = [0] * world
    for cost, _, members in sorted(matrices, key=lambda m: (-m[0], m[1])):  # largest first, ties by FQN
        if not members:  # held whole: every rank
            for r in range(world):
                two_d[r] += cost
            continue
        heap = heaps.setdefault(members, [(0, j) for j in range(len(members))])
        own, j = heapq.heappop(heap)
        two_d[members[j]] += cost
        heapq.heappush(heap, (own + cost, j))
    load = [a + b for a, b in zip(expert_flops, two_d)]
    busiest = max(range(world), key=load.__getitem__)
    return {"applies": True, "busiest_flops": load[busiest], "busiest_experts": experts[busiest],
            "idle_expert_ranks": sum(1 for n in experts if n == 0) if any(experts) else 0,
            "max_experts": max(experts)}


def moe_figures(built: Built, specs: list | None) -> dict[str, Any]:
    """The MoE row's own figures (the module doc); ``specs``: GefenMuon's matrices (None: no Muon rows)."""
    muon = [p for p in built.params if is_muon(built, p)]
    grouped = [p for p in muon if len(p.shape) == 3]
    out: dict[str, Any] = {"hybrid_state": max(state_per_rank(built, "hybrid")),
                           "distmuon_state": max(state_per_rank(built, "distmuon")),
                           "muon_share": sum(math.prod(p.shape) for p in muon) / built.numel}
    if grouped:
        p = grouped[0]
        out["experts"] = {"weights": len(grouped), "per_weight": p.shape[0],
                          "placements": ", ".join(repr(pl).replace("dim=", "") for pl in p.placements),
                          "per_rank": max(sizes[0] for sizes, _ in Chunks().per_rank(p.shape, p))}
    if specs is not None:
        out["distmuon"] = distmuon_plan(built, specs)
    return out


def moe_table(rows: list[dict]) -> str:

    lines = ["| flavor | mesh | W | experts (placements) | Muon share | GefenMuonHybrid state/rank | Gefen "
             "state/rank | DistMuon + AdamW state/rank | AdamW state/rank | GefenMuon busiest NS (/ mean) "
             "| DistMuon busiest NS (experts; idle ranks) | DistMuon / GefenMuon |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.get("moe")
        if not m:
            continue
        mu, d = r.get("muon") or {}, m.get("distmuon") or {}
        ours = (f"{fmt_flops(mu['busiest_flops'])} ({mu['busiest_flops'] / mu['mean_flops']:.2f})" if mu else "")
        if d.get("applies"):
            theirs = f"{fmt_flops(d['busiest_flops'])} ({d['busiest_experts']}; {d['idle_expert_ranks']})"
            ratio = f"{d['busiest_flops'] / mu['busiest_flops']:.2f}" if mu else ""
        else:
            theirs, ratio = d.get("why", ""), ""
        e = m.get("experts") or {"weights": 0, "per_weight": 0, "per_rank": 0, "placements": ""}
        lines.append(
            f"| {r['flavor']} | {r['label']} | {r['world']} | {e['weights']} x {e['per_weight']}, {e['per_rank']}/rank "
            f"({e['placements']}) | {m['muon_share']:.3f} | {fmt_bytes(m['hybrid_state'])} "
            f"| {fmt_bytes(r['gefen_state'])} "
            f"| {fmt_bytes(m['distmuon_state'])} | {fmt_bytes(r['adamw_state'])} | {ours} | {theirs} | {ratio} |")
    return "\n".join(lines)


# figure -> (per-rank value, job-wide value), the MoE rows' own (scale.FIGURES' layout)
MOE_FIGURES = {
    "GefenMuonHybrid state / rank": (lambda r: r["moe"]["hybrid_state"],
                                     lambda r: r["moe"]["hybrid_state"] * r["world"]),
    "DistMuon + AdamW state / rank": (lambda r: r["moe"]["distmuon_state"],
                                      lambda r: r["moe"]["distmuon_state"] * r["world"]),
}


def report_moe(rows: list[dict]) -> None:
    """Print the MoE rows' GefenMuon step and their comparison table."""

    if any(r.get("muon") for r in rows):
        mib = next(r["muon"]["bucket_mib"] for r in rows if r.get("muon"))
        print("\nMixture of experts: GefenMuon's step per optimizer step on GefenMuonHybrid's matrices (the blocks' "
              "nn.Linear weights but the router's gate, and one matrix per routed expert), its default "
              f"Newton-Schulz schedule, muon_bucket_mib {mib:g}; columns as above\n")
        print(muon_table(rows))
    print("\nMixture of experts, per rank (worst rank): routed experts per grouped weight held per rank; the share "
          "of the parameters GefenMuon steps; GefenMuonHybrid (GefenMuon + Gefen) against DistMuon (torchtitan "
          "main, fp32 momentum) + AdamW; the busiest rank's Newton-Schulz FLOPs per step (GefenMuon: its "
          "schedule, over the mean; DistMuon: the experts of its Shard(0) chunk plus its owned 2-D matrices; "
          "idle ranks: ranks whose chunk holds no expert)\n")
    print(moe_table(rows))
