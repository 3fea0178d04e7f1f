"""Scale plan: Gefen vs AdamW for Llama 3 8B-405B and MoE models at 8-1024 ranks, computed on the meta device.

For every flavor (``--flavors``), mesh kind (``--meshes``: ``fsdp``, FSDP
over all ranks; ``fsdp_tp``, FSDP x TP ``--tp``; ``hsdp``, replicas x
``--hsdp-shard`` shards) and world size (``--worlds``), the plan builds the
model as a training run would: ``recipes/llama3_8b_gefen.toml`` with the
flavor and degrees overridden, torchtitan's fake process group at that
world size, the model on the meta device (no memory, no compute),
torchtitan's own ``parallelize_fn`` (FSDP2, TP plan, activation
checkpointing) and our optimizer container. From the parameters' real
global shapes and placements it computes, for every rank (each rank's
shard from DTensor's own ``_compute_local_shape_and_global_offset``):

* **Gefen state bytes** per rank, as the optimizer holds them, by the rule
  of its registry entry (``cost``, ``optim.state_cost.StateCost``, which
  ``state_bytes`` reads for any kind): 1 B per
  element (codes) + 16 B per block (fp32 magnitude and ``vmean``, and
  gefen-x's per-step scratch ``stepsize`` and ``_h_buf``, which live in the
  state but are not checkpointed) + the 1 KiB codebook; period-1 parameters
  (norms) 17 B per element. Periods need gradients, so the plan applies the
  adapter's own rules without them: each parameter's row unit and
  candidates come from ``AgreedBlocking.period_candidates`` (the row length
  cut by the live layout and by every TP degree dividing
  ``--max-tp-degree``), and the period is the rule's memory-safe fallback,
  the whole row unit, which is what agreed blocking picks when the
  block-variance scores find no block structure (gefen-x measures that as
  the usual case on SwiGLU/GQA models). The finest period the rule can pick
  (the smallest candidate >= 8: a winner below 8 becomes the fallback)
  bounds the state from above ("finest"). AdamW (its entry's rule too):
  ``exp_avg`` and ``exp_avg_sq`` (fp32) + a scalar ``step`` per parameter.
* **Checkpoint**: the DCP entries of the optimizer, as the container's
  ``state_dict()`` gives them (Gefen's: format v3, as its entry's checkpoint
  description plans them, ``checkpoint.format.kinds.PlannedEntries``; AdamW's
  flat keys taken from a real torchtitan container on a small model), and
  every rank's write items, deduplicated with the same greedy rule as
  DCP's ``dedup_save_plans`` (replicated chunks, the shared records and
  empty shards at the same offset are written once). Per rank: bytes
  written (each item framed as ``torch.save`` frames it) and items
  written; for the job: entries, chunks, and the size of the ``.metadata``
  file. The metadata is built with DCP's own code (per-rank ``SavePlan``
  objects pickled and unpickled as the gather does, ``DefaultSavePlanner``'s
  global plan, the write results of ``FileSystemWriter``'s layout), then
  pickled as ``FileSystemWriter.finish`` pickles it. Where the job has more
  than ``--exact-items`` plan items it is built for the first one and two
  layers of each kind of layer (``layer_kinds``: a dense model has one,
  DeepSeek-V3 two; and once with a layer renamed to one more digit) and
  extrapolated over the layers (``~``): layers of a kind are identical, so
  this is exact up to the pickled size of file offsets (a few bytes per
  chunk; ``tests/integration/test_scale.py`` bounds it against the full
  build, dense and MoE). Every rank
  reads the whole metadata on every load, so its job-wide cost is W times
  its size. The coordinator also receives every rank's plan and write
  results (``gather at rank 0``).
* **GefenMuon's step** (``muon_plan``; ``--no-muon`` leaves it out): the
  muon recipe's hidden matrices (MoE: GefenMuonHybrid's; ``muon_specs``
  asks the layout module, ``muon.matrices``) with their real placements, scheduled as
  the step schedules them (``optim.muon.schedule``, ``--muon-bucket-mib``):
  the busiest owner's Newton-Schulz FLOPs against the mean and the largest
  matrix, the serial sum every rank waited on before, exchange and
  in-flight bytes per rank.
* **First-step collectives** (Gefen's agreement, ``blocking.
  agreement_collectives``): per rank the bytes each collective gathers;
  the candidate width is the real candidate count of every searched
  parameter. AdamW has none.

Then, per flavor, mesh and figure, how it grows with W: the least-squares
slope of log(figure) over log(W) per rank and for the whole job (per-rank
figure summed over the ranks, or the metadata read by every rank), and a
flag for any job-wide figure that grows faster than linearly (slope > 1.1).

**Mixture of experts** (``--moe``; ``MOE_FLAVORS``: torchtitan 0.3.0's
DeepSeek-V3 671B / 16B and Qwen3 30B-A3B, from
``benchmarks/recipes/``): the same figures at ``ep`` meshes (``--ep``
degrees: FSDP over every rank for the dense parameters, the routed experts
cut by EP x efsdp as torchtitan's parallelize cuts them), the metadata
extrapolated per kind of layer (``layer_kinds``: DeepSeek-V3's dense first
layers and its MoE layers), GefenMuon's matrices those GefenMuonHybrid routes
(one per routed expert of a grouped weight, from ``muon.matrices.matrix_cuts``),
and the rows' own figures from ``benchmarks.scale_moe`` (GefenMuonHybrid's
state, torchtitan main's DistMuon beside it).

    python scripts/plan_scale.py                          # small: 8B x fsdp x 8, 64, 1024 ranks (minutes)
    python scripts/plan_scale.py --full                   # 8B, 70B, 405B x fsdp, fsdp_tp, hsdp x 8..1024 (~35 min)
    python scripts/plan_scale.py --flavors 8B --meshes fsdp --worlds 8,64,512
    python scripts/plan_scale.py --moe                    # DSv3-671B, Qwen3-30B-A3B x EP 8, 64 x 64, 256, 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pickle
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import scale_factored, scale_moe
from benchmarks.meta import build_on_meta
from benchmarks.scale_parts import (
    LAYER,
    MUON_NS_STEPS,
    Built,
    Chunks,
    Mesh,
    Param,
    fmt_bytes,
    is_muon,
    muon_table,
)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/llama3_8b_gefen.toml"
FLAVORS = ("8B", "70B", "405B")
MESHES = ("fsdp", "fsdp_tp", "hsdp")
# Mixture-of-experts meshes (benchmarks/scale_moe.py): FSDP over every rank for the dense parameters, the
# routed experts cut by EP (``--ep``) x efsdp (world / EP), as torchtitan 0.3.0 shards them.
MOE_MESHES = ("ep",)
# MoE flavors: name -> (recipe, the recipe's [model] flavor). torchtitan 0.3.0's own models and flavors; the
# recipes are the plan's (benchmarks/recipes/), not shipped ones. "DSv3-debug" is the checks' small one.
MOE_FLAVORS = {
    "DSv3-671B": ("benchmarks/recipes/dsv3_scale.toml", "671B"),
    "DSv3-16B": ("benchmarks/recipes/dsv3_scale.toml", "16B"),
    "Qwen3-30B-A3B": ("benchmarks/recipes/qwen3_moe_scale.toml", "30B-A3B"),
    "DSv3-debug": ("benchmarks/recipes/dsv3_scale.toml", "debugmodel"),
}
MOE_DEFAULT = ("DSv3-671B", "Qwen3-30B-A3B")
EP_DEGREES = (8, 64)
MOE_WORLDS = (64, 256, 1024)
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
# Without flags, a small plan that finishes in minutes (the full one, FLAVORS x MESHES x WORLDS, took 35
# min on a 2-core host and printed nothing until its first cell finished): --full asks for it.
SMALL = {"flavors": ("8B",), "meshes": ("fsdp",), "worlds": (8, 64, 1024)}
FLAG_SLOPE = 1.1  # job-wide growth above this slope is "faster than linear"

__all__ = ["Mesh", "mesh_for", "build", "plan", "growth", "flags", "main"]


def mesh_for(kind: str, world: int, tp: int = 8, hsdp_shard: int = 8, ep: int = 8) -> Mesh:
    if kind == "ep":
        if world % ep:
            raise ValueError(f"ep: world {world} is not a multiple of EP {ep}")
        return Mesh(kind, world, ep=ep)
    if kind == "fsdp":
        return Mesh(kind, world)
    if kind == "fsdp_tp":
        if world % tp:
            raise ValueError(f"fsdp_tp: world {world} is not a multiple of --tp {tp}")
        return Mesh(kind, world, tp=tp)
    if kind == "hsdp":
        if world % hsdp_shard:
            raise ValueError(f"hsdp: world {world} is not a multiple of --hsdp-shard {hsdp_shard}")
        return Mesh(kind, world, replicate=world // hsdp_shard)
    raise ValueError(f"unknown mesh kind {kind!r} (known: {', '.join(MESHES + MOE_MESHES)})")


def _coords(mesh, world: int, fqn: str) -> list[tuple[int, ...]]:
    ranks = mesh.mesh
    if ranks.numel() != world:
        raise ValueError(f"{fqn}: its mesh covers {ranks.numel()} of {world} ranks; the plan handles meshes "
                         "over every rank (no pipeline parallelism)")
    shape = tuple(ranks.shape)
    out: list[tuple[int, ...] | None] = [None] * world
    for flat, r in enumerate(ranks.flatten().tolist()):
        coord, rest = [], flat
        for size in reversed(shape):
            coord.append(rest % size)
            rest //= size
        out[r] = tuple(reversed(coord))
    return out  # type: ignore[return-value]


def _adamw_template(config) -> list[tuple[str, str, Any]]:
    """AdamW's flat checkpoint keys per parameter, from a real torchtitan container.

    A two-parameter model with the recipe's optimizer settings (name AdamW)
    and LR schedule (which adds ``initial_lr``), stepped once: its
    ``state_dict()`` keys with the parameter's name replaced by ``{fqn}``,
    each with its kind (a tensor like the parameter, a plain tensor, or
    bytes with its value).
    """
    from gefen_titan.optim.container import GefenOptimizersContainer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    cfg = dataclasses.replace(config.optimizer, name="AdamW", param_groups=[])
    container = GefenOptimizersContainer(cfg, model_parts=[model])
    config.lr_scheduler.build(optimizers=container, training_steps=config.training.steps)
    model(torch.ones(1, 4)).sum().backward()
    container.step()
    names = [n for n, _ in model.named_parameters()]
    out = []
    for key, value in container.state_dict().items():
        if names[0] not in key:
            continue
        pattern = key.replace(names[0], "{fqn}")
        if isinstance(value, torch.Tensor):
            kind = "like_param" if tuple(value.shape) == (4, 4) else "tensor"
            out.append((pattern, kind, (value.dtype, tuple(value.shape))))
        else:
            out.append((pattern, "bytes", value))
    return out


def build(flavor: str, mesh: Mesh, max_tp: int = 8, recipe: str = RECIPE, second_moment: str | None = None) -> Built:
    """The flavor on the meta device under ``mesh``, as the Trainer builds it (collective-free).

    A MoE flavor (``MOE_FLAVORS``) builds from its own recipe (``recipe`` is
    the dense flavors'), and its GefenMuon matrices are the ones
    GefenMuonHybrid routes (``gefen_titan.optim.hybrid.route``: every
    ``nn.Linear`` weight in the blocks but the router's gate, and the routed
    experts' grouped weights), with the hybrid's Newton-Schulz steps.

    ``second_moment``: ``[optimizer.gefen] second_moment`` over the recipe's (None: the recipe's).

    Replaces any process group of this process by torchtitan's fake one at
    ``mesh.world`` ranks: run it in a process of its own, never inside a job.
    """
    model_flavor = flavor
    if flavor in MOE_FLAVORS:
        recipe, model_flavor = MOE_FLAVORS[flavor]
    overrides = {"model": {"flavor": model_flavor}, "parallelism": mesh.parallelism(),
                 "optimizer": {"blocking": {"max_tensor_parallel_degree": max_tp}}}
    if second_moment is not None:
        overrides["optimizer"]["gefen"] = {"second_moment": second_moment}
    built = build_on_meta(str(ROOT / recipe) if not Path(recipe).exists() else recipe, mesh.world, overrides)
    config = built.config
    muon: dict[str, Any] = {}
    if flavor in MOE_FLAVORS:
        from gefen_titan.optim import hybrid

        groups = hybrid.param_groups(dataclasses.replace(config.optimizer, name=hybrid.NAME, param_groups=[]))
        muon = {"muon_fqns": frozenset(hybrid.route(built.model)[0]),
                "muon_ns_steps": int(groups[0].optimizer_kwargs["ns_steps"])}
    ckpt_id = str(Path(config.dump_folder) / config.checkpoint.folder / f"step-{config.training.steps}")
    gefen = dataclasses.replace(config.optimizer.gefen,
                                second_moment=config.optimizer.gefen.resolved_second_moment(config.optimizer))
    return built_from(flavor, mesh, built.numel, built.optimizers, config.optimizer.blocking.max_tensor_parallel_degree,
                      ckpt_id, _adamw_template(config), gefen_options=gefen, **muon)


def built_from(flavor: str, mesh: Mesh, numel: int, container, max_tp: int, checkpoint_id: str,
               adamw_template: list[tuple[str, str, Any]], gefen_options: Any = None, **muon: Any) -> Built:
    """The plan's view of a built optimizer container (its Gefen parameters, their layouts and blocking
    rules), for ``build`` and for the checks that build a model of their own."""
    from gefen_titan.optim.blocking import AgreedBlocking

    agreement = AgreedBlocking(max_tp)
    coords_by_mesh: dict[int, list] = {}
    params = []
    for fqn, p, unit, candidates in agreement.period_candidates(container.optimizers_of("Gefen")):
        key = id(p.device_mesh)
        if key not in coords_by_mesh:
            coords_by_mesh[key] = _coords(p.device_mesh, mesh.world, fqn)
        params.append(Param(fqn, tuple(p.shape), p.dtype, tuple(p.placements), tuple(p.device_mesh.shape),
                            coords_by_mesh[key], unit, candidates, p))
    from gefen_titan.optim.kinds.gefen.keys import HYPER

    group = container.optimizers_of("Gefen")[0].param_groups[0]
    hyper = {k: float(group[k]) for k in HYPER}
    from gefen_titan.optim import gefenx as gx

    return Built(flavor, mesh, numel, params, checkpoint_id, adamw_template, hyper,
                 gx.options(container.optimizers_of("Gefen")[0])["deterministic"], gefen_options, **muon)


# ---------------------------------------------------------------- entries
@dataclass
class Entry:
    """One DCP entry of the optimizer's state dict."""

    key: str  # flattened DCP key ("optimizer." + the container's key)
    kind: str  # "dtensor" | "tensor" (plain, every rank) | "bytes" (every rank)
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    param: Param | None = None
    value: Any = None  # bytes entries: the object DCP torch.saves
    layer: int | None = None


def _placed_like(p: Param, key: str, shape: tuple[int, ...]) -> Param:
    """The layout of one of ``p``'s state entries: the parameter's own, but a factored parameter's rows
    (``vrow``) and columns (``vcol``), which the adapter places like those dims of it
    (``distributed.like_param_rows`` / ``like_param_cols``: a cut of the other dim replicates them)."""
    from torch.distributed.tensor import DTensor

    from gefen_titan.checkpoint.format import schema
    from gefen_titan.distributed import layout

    parsed = schema.parse_key(key)
    kind = parsed.kind if parsed is not None else None
    if kind not in ("vrow", "vcol") or not isinstance(p.tensor, DTensor):
        return p
    placements = (layout.leading_placements(p.tensor, len(shape)) if kind == "vrow"
                  else layout.column_placements(p.tensor))
    return dataclasses.replace(p, shape=tuple(shape), placements=tuple(placements))


def optimizer_entries(built: Built, name: str, rule: str = "fallback", periods: dict[str, int] | None = None,
                      step: int = 1) -> list[Entry]:
    """The v3 entries of one optimizer of kind ``name`` over the plan's parameters: the header, then what its
    registry entry's description plans (``checkpoint.format.kinds.PlannedEntries``: Gefen's are
    ``ShardedAdapter._save_entries``' order and records)."""
    from gefen_titan.checkpoint.format import schema, schema_records
    from gefen_titan.checkpoint.format.kinds import PlannedParam
    from gefen_titan.optim import registry

    planned = registry.get(name).checkpoint.planned_entries
    plan_options = ({"second_moment": built.gefen_options.resolved_second_moment()}
                    if name == "Gefen" and built.gefen_options is not None else {})
    pre = "optimizer."
    out = [Entry(pre + schema.header_key(), "bytes",
                 value=schema_records.Header.for_blocking("agreed").to_json())]
    params = []
    for p in built.params:
        period = (periods or {}).get(p.fqn) or p.period(rule)
        params.append(PlannedParam(p.fqn, tuple(p.shape), period, step, dict(built.gefen_hyper), plan_options))
        for key, (dtype, shape) in planned.param_tensors(params[-1]).items():
            out.append(Entry(pre + key, "dtensor", dtype, shape, _placed_like(p, key, shape), layer=p.layer))
    for key, value in planned.optimizer_entries(built.params[0].fqn, params, step, built.deterministic).items():
        if isinstance(value, tuple):  # a plain tensor: (dtype, shape)
            out.append(Entry(pre + key, "tensor", value[0], value[1]))
        else:
            out.append(Entry(pre + key, "bytes", value=value))
    return out


def adamw_entries(built: Built) -> list[Entry]:
    """torchtitan's flat AdamW keys: every parameter's state, then every parameter's group keys."""
    out = []
    state = [t for t in built.adamw_template if t[0].startswith("state.")]
    groups = [t for t in built.adamw_template if not t[0].startswith("state.")]
    for template in (state, groups):
        for p in built.params:
            for pattern, kind, info in template:
                key = "optimizer." + pattern.format(fqn=p.fqn)
                if kind == "like_param":
                    out.append(Entry(key, "dtensor", info[0], p.shape, p, layer=p.layer))
                elif kind == "tensor":
                    out.append(Entry(key, "tensor", info[0], info[1], layer=p.layer))
                else:
                    out.append(Entry(key, "bytes", value=info, layer=p.layer))
    return out


# ------------------------------------------------------------- accounting
class _Sink:
    def __init__(self) -> None:
        self.n = 0

    def write(self, b) -> int:
        self.n += len(b)
        return len(b)

    def flush(self) -> None:
        pass


_SAVED: dict[Any, int] = {}
# Above this many bytes a chunk's framing is taken from a same-ndim small
# tensor (the framing varies by < 64 B with the shape's digits and padding).
_EXACT_SAVE_BYTES = 1 << 24


def saved_length(obj: Any) -> int:
    """Bytes DCP's FileSystemWriter writes for one item: ``torch.save``'s output."""
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], torch.dtype):
        dtype, sizes = obj
        key = ("t", dtype, tuple(sizes))
        if key not in _SAVED:
            nbytes = math.prod(sizes) * torch._utils._element_size(dtype)
            if nbytes <= _EXACT_SAVE_BYTES:
                sink = _Sink()
                torch.save(torch.zeros(sizes, dtype=dtype), sink)
                _SAVED[key] = sink.n
            else:
                small = (64,) * len(sizes)
                _SAVED[key] = (saved_length((dtype, small)) - math.prod(small) * torch._utils._element_size(dtype)
                               + nbytes)
        return _SAVED[key]
    try:
        key = ("v", type(obj).__name__, obj)
        hash(key)
    except TypeError:
        key = None
    if key is None or key not in _SAVED:
        sink = _Sink()
        torch.save(obj, sink)
        if key is None:
            return sink.n
        _SAVED[key] = sink.n
    return _SAVED[key]


@dataclass
class Accounting:
    entries: int
    chunks: int
    items: int  # plan items over all ranks (before dedup)
    bytes_per_rank: list[int]
    items_per_rank: list[int]
    assignment: dict[tuple, int] = field(default_factory=dict)  # (key, offsets) -> writing rank, replicated only


def _storage_size(e: Entry) -> int:
    """What ``WriteItem.tensor_storage_size`` counts: the *global* size (0 for bytes)."""
    return math.prod(e.shape) * torch._utils._element_size(e.dtype) if e.kind != "bytes" else 0


def account(entries: list[Entry], world: int, chunks: Chunks, keep_assignment: bool = False) -> Accounting:
    """Every rank's write items, deduplicated as ``dedup_save_plans`` does.

    DCP maps each write item index (key, chunk offsets) to the plans holding
    it and then, in first-appearance order (plan 0's items in state-dict
    order, then plan 1's new ones, ...: by lowest holder, then entry), gives
    it to the holder with the least storage planned so far (non-tensors
    count 1), ties to the holder its set iterates first. The holder sets are
    built as DCP builds them (ranks added in ascending order), so the choice
    is the same; ``tests/integration/test_scale.py`` checks it against DCP's own
    function.
    """
    from gefen_titan.checkpoint.format import schema

    everyone = list(range(world))
    uniques = []  # (first holder, entry position, holders, their chunk sizes, entry, offsets)
    for pos, e in enumerate(entries):
        if e.kind == "dtensor":
            for offsets, ranks, sizes in chunks.groups(e.shape, e.param):
                uniques.append((ranks[0], pos, ranks, sizes, e, offsets))
        else:
            uniques.append((0, pos, everyone, None, e, (0,) * len(e.shape) if e.kind == "tensor" else None))
    uniques.sort(key=lambda u: (u[0], u[1]))
    plan_size = [0] * world
    written = [0] * world
    count = [0] * world
    sets: dict[int, set] = {}
    assignment = {}
    storage = {id(e): _storage_size(e) or 1 for e in entries}
    raw = {id(e): schema.is_raw_entry(e.key) for e in entries}
    for _, _, ranks, sizes, e, offsets in uniques:
        if len(ranks) == 1:
            pick, i = ranks[0], 0
        else:
            holder_set = sets.get(id(ranks))
            if holder_set is None:
                sets[id(ranks)] = holder_set = set(ranks)
            pick = min(holder_set, key=plan_size.__getitem__)
            i = pick if ranks is everyone else ranks.index(pick)
            if keep_assignment:
                assignment[(e.key, offsets)] = pick
        if e.kind == "dtensor" and raw[id(e)]:  # format v3's raw entries: the chunk's bytes alone
            length = math.prod(sizes[i]) * torch._utils._element_size(e.dtype)
        elif e.kind == "dtensor":
            length = saved_length((e.dtype, sizes[i]))
        elif e.kind == "tensor":
            length = saved_length((e.dtype, e.shape))
        else:
            length = saved_length(e.value)
        plan_size[pick] += storage[id(e)]
        written[pick] += length
        count[pick] += 1
    items = world * len(entries)
    return Accounting(len(entries), len(uniques), items, written, count, assignment)


# ------------------------------------------------------------ DCP metadata
def _fresh(text: str) -> str:
    """An equal string that is a new object (one rank's copy after the gather)."""
    return (text + " ")[:-1]


def metadata_bytes(entries: list[Entry], world: int, chunks: Chunks, checkpoint_id: str,
                   sample_ranks: int = 3) -> dict[str, Any]:
    """The pickled ``.metadata`` DCP writes for these entries, built with DCP's own planner code.

    Per rank, the ``SavePlan`` DCP's default planner makes (a DTensor: its
    chunk; plain tensors and bytes: on every rank; the flatten mapping as
    planner data), with the object sharing the gather's unpickling leaves
    (each rank's strings its own, shared within the rank); dedup and
    metadata with DCP's ``dedup_save_plans`` and
    ``create_default_global_save_plan``, planner data merged as
    ``DefaultSavePlanner._create_global_plan`` merges it (its global-plan
    validation, quadratic in the chunks of an entry, is left out);
    ``FileSystemWriter.prepare_global_plan``; each rank's single file laid
    out as ``write_data`` lays it out (``_split_by_size_and_type``, bytes
    first) with each item's saved length; the results as the coordinator
    unpickles them; then ``finish``'s metadata, pickled.

    ``gathered``: the pickled plans and results the coordinator receives,
    from ``sample_ranks`` ranks spread over the job, scaled to all.
    """
    from collections import ChainMap

    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.filesystem import (
        CURRENT_DCP_VERSION,
        FileSystemWriter,
        _split_by_size_and_type,
        _StorageInfo,
    )
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from gefen_titan.checkpoint.format import schema

    sampled = sorted({round(i * (world - 1) / max(1, sample_ranks - 1)) for i in range(sample_ranks)})
    plan_bytes = []
    plans = []
    tables = [chunks.per_rank(e.shape, e.param) if e.kind == "dtensor" else None for e in entries]
    for r in range(world):
        top = _fresh("optimizer")
        items, mapping = [], {}
        for e, table in zip(entries, tables):
            fqn = _fresh(e.key)
            mapping[fqn] = (top, _fresh(e.key.partition(".")[2]))
            if e.kind == "dtensor":
                sizes, offsets = table[r]
                offsets, sizes = torch.Size(offsets), torch.Size(sizes)
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk,
                                                                   properties=TensorProperties(dtype=e.dtype),
                                                                   size=torch.Size(e.shape))))
            elif e.kind == "tensor":
                offsets = torch.Size((0,) * len(e.shape))
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(e.shape))
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.TENSOR,
                                       tensor_data=TensorWriteData(chunk=chunk,
                                                                   properties=TensorProperties(dtype=e.dtype),
                                                                   size=torch.Size(e.shape))))
            else:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        plan = SavePlan(items, planner_data=mapping)
        if r in sampled:
            plan_bytes.append(len(pickle.dumps(plan)))
        plans.append(plan)
    plans = dedup_save_plans(plans, False)
    global_plans, md = create_default_global_save_plan(plans)
    md = dataclasses.replace(md, planner_data=dict(ChainMap(*[p.planner_data for p in global_plans])))
    global_plans = FileSystemWriter("/nonexistent").prepare_global_plan(global_plans)
    by_key = {e.key: e for e in entries}
    storage, result_bytes = {}, []
    for r, plan in enumerate(global_plans):
        (bucket,) = _split_by_size_and_type(1, plan.items)
        file_name = f"{plan.storage_data.prefix}0.distcp"
        offset, res = 0, []
        ordered = ([w for w in bucket if w.type == WriteItemType.BYTE_IO]
                   + [w for w in bucket if w.type != WriteItemType.BYTE_IO])
        for w in ordered:
            e = by_key[w.index.fqn]
            if w.type == WriteItemType.BYTE_IO:
                length = saved_length(e.value)
            elif schema.is_raw_entry(w.index.fqn):
                length = math.prod(w.tensor_data.chunk.sizes) * torch.empty((), dtype=e.dtype).element_size()
            else:
                length = saved_length((e.dtype, tuple(w.tensor_data.chunk.sizes)))
            index = MetadataIndex(_fresh(w.index.fqn), None if w.index.offset is None else torch.Size(w.index.offset),
                                  w.index.index)
            res.append(WriteResult(index=index, size_in_bytes=length,
                                   storage_data=_StorageInfo(file_name, offset, length)))
            offset += length
        if r in sampled:
            result_bytes.append(len(pickle.dumps(res)))
        storage.update((wr.index, wr.storage_data) for wr in res)
    md.version = CURRENT_DCP_VERSION
    md.storage_data = storage
    md.storage_meta = StorageMeta(checkpoint_id=Path(checkpoint_id), save_id="0" * 32 + "-uuid")
    gathered = world * (sum(plan_bytes) / len(plan_bytes) + sum(result_bytes) / len(result_bytes))
    return {"metadata": len(pickle.dumps(md)), "gathered": int(gathered)}


def _subset(entries: list[Entry], keep: set[int], rename: tuple[int, int] | None = None) -> list[Entry]:
    """The non-layer entries and those of the layers in ``keep`` (optionally one layer renamed)."""
    out = []
    for e in entries:
        if e.layer is not None and e.layer not in keep:
            continue
        if rename and e.layer == rename[0]:
            e = dataclasses.replace(e, key=re.sub(rf"layers\.{rename[0]}\.", f"layers.{rename[1]}.", e.key))
        out.append(e)
    return out


def layer_kinds(entries: list[Entry]) -> list[list[int]]:
    """The layers grouped by kind, each kind's layers ascending: layers of one kind have the same
    entries (keys but for the layer index, dtypes, shapes and layouts). A dense model has one
    kind; DeepSeek-V3 two (its first dense layers, then the MoE ones)."""
    signature: dict[int, list] = defaultdict(list)
    for e in entries:
        if e.layer is not None:
            layout = (e.param.placements, e.param.mesh_shape) if e.param is not None else None
            signature[e.layer].append((LAYER.sub(r"\1layers.#.", e.key), e.kind, e.dtype, e.shape, str(layout)))
    kinds: dict[tuple, list[int]] = defaultdict(list)
    for layer in sorted(signature):
        kinds[tuple(signature[layer])].append(layer)
    return list(kinds.values())


def metadata_estimate(entries: list[Entry], world: int, chunks: Chunks, checkpoint_id: str, items: int,
                      exact_items: int) -> dict[str, Any]:
    """Exact for up to ``exact_items`` plan items, else extrapolated over the layers of each kind.

    Built for the first layer of every kind (``one``) and the first two
    (``two``). A kind's layer costs what its second layer adds to ``one``
    (for the kind with the most layers: what ``two`` adds to ``one`` beyond
    the others' second layers, which saves a build), and a digit what renaming
    its first layer to one more digit adds; every further layer of the kind
    adds its layer's cost and its digits beyond the second layer's. With one
    kind this is the first and first two layers, and layer 0 renamed to 10.
    """
    kinds = layer_kinds(entries)
    if items <= exact_items or all(len(k) < 3 for k in kinds):
        out = metadata_bytes(entries, world, chunks, checkpoint_id)
        out["exact"] = True
        return out
    firsts = {k[0] for k in kinds}
    one = metadata_bytes(_subset(entries, firsts), world, chunks, checkpoint_id)
    two = metadata_bytes(_subset(entries, firsts | {k[1] for k in kinds if len(k) > 1}), world, chunks,
                         checkpoint_id)
    main = max(kinds, key=len)
    per_layer: dict[int, dict[str, int]] = {}
    for k in kinds:
        if len(k) > 1 and k is not main:
            second = metadata_bytes(_subset(entries, firsts | {k[1]}), world, chunks, checkpoint_id)
            per_layer[k[0]] = {what: second[what] - one[what] for what in ("metadata", "gathered")}
    per_layer[main[0]] = {what: two[what] - one[what] - sum(v[what] for v in per_layer.values())
                          for what in ("metadata", "gathered")}
    out: dict[str, Any] = {"exact": False, "metadata": two["metadata"], "gathered": two["gathered"]}
    for k in kinds:
        if len(k) < 3:
            continue
        extra_digits = sum(len(str(layer)) - len(str(k[1])) for layer in k[2:])
        digit = {"metadata": 0, "gathered": 0}
        if extra_digits:
            digits = len(str(k[0])) + 1  # one more digit (0 -> 10, 3 -> 13), no other kind's first layer
            wider = next(n for n in range(10 ** (digits - 1) + k[0], 10 ** digits) if n not in firsts)
            wide = metadata_bytes(_subset(entries, firsts, rename=(k[0], wider)), world, chunks, checkpoint_id)
            digit = {what: wide[what] - one[what] for what in digit}
        for what in ("metadata", "gathered"):
            out[what] += (len(k) - 2) * per_layer[k[0]][what] + extra_digits * digit[what]
    return out


# ------------------------------------------------------------------- plan
def state_bytes(built: Built, name: str, rule: str = "fallback", periods: dict[str, int] | None = None,
                options: Any = None) -> list[int]:
    """Per rank: the state of one optimizer of kind ``name`` over the plan's parameters, by its registry entry's
    rule (``optim.state_cost.StateCost``, under the kind's ``options`` table if given), periods by ``rule`` or
    the given ``periods``."""
    from gefen_titan.optim import registry

    if options is None and name == "Gefen":
        options = built.gefen_options  # the recipe's (None: the kind's defaults)
    cost = registry.get(name).cost.under(options)
    chunks = Chunks()
    out = [cost.optimizer_bytes] * built.mesh.world
    for p in built.params:
        period = (periods or {}).get(p.fqn) or p.period(rule)
        elem = torch._utils._element_size(p.dtype)
        for r, (sizes, _) in enumerate(chunks.per_rank(p.shape, p)):
            out[r] += cost.param_bytes(tuple(sizes), period, elem)
    return out


def collectives(built: Built) -> list[dict[str, Any]]:
    from gefen_titan.optim import registry
    from gefen_titan.optim.blocking import agreement_collectives

    searched = [p for p in built.params if p.unit]
    width = sum(len(p.candidates) for p in searched)
    w = built.mesh.world
    out = []
    for what, op, dtype, numel in agreement_collectives(width, len(searched), registry.codebook_families()):
        payload = numel * torch._utils._element_size(dtype)
        per_rank = payload * w if op == "all_gather" else payload
        out.append({"what": what, "op": op, "dtype": str(dtype).replace("torch.", ""), "numel": numel,
                    "payload": payload, "per_rank": per_rank})
    return out


def muon_specs(built: Built, rank: int = 0) -> list:
    """GefenMuon's matrices as rank ``rank``'s copy sees them, as the sharded step builds them.

    The copy is ``muon.matrices.shard_groups``' (the layout module's
    ``copy_groups``) and each parameter's matrices and their holders' pieces
    are ``muon.matrices.matrix_cuts``' (a 2-D parameter one matrix; a grouped
    experts' weight one per expert, held by the members whose shard holds
    part of it): the plan computes no shard itself. Both are cached per mesh
    and layout, since the layers repeat; a cached parameter's matrices are
    renamed to the next one's FQN. Each becomes a ``MatrixSpec`` as
    ``ShardedMuonStep`` makes it: members are the pieces' ranks (none: held
    whole), an expert names its grouped weight as ``param``.
    """
    from gefen_titan.optim.muon import MatrixSpec
    from gefen_titan.optim.muon.matrices import matrix_cuts, shard_groups

    copies: dict[tuple, list] = {}
    cuts_by_layout: dict[tuple, tuple[str, list]] = {}
    out = []
    for p in built.params:
        if not is_muon(built, p):
            continue
        mesh = getattr(p.tensor, "device_mesh", None)
        copy_key = (id(mesh), tuple(pl.is_replicate() for pl in p.placements))
        if copy_key not in copies:
            copies[copy_key] = [] if mesh is None else \
                next(g for g in shard_groups(p.tensor) if any(r == rank for r, _ in g))
        layout_key = (p.shape, str(p.placements), p.mesh_shape, copy_key)
        if layout_key not in cuts_by_layout:
            cuts_by_layout[layout_key] = (p.fqn, matrix_cuts(p.fqn, p.shape, p.mesh_shape if mesh else (1,),
                                                             p.placements if mesh else (), copies[copy_key]))
        first, cuts = cuts_by_layout[layout_key]
        for c in cuts:
            fqn = p.fqn + c.fqn[len(first):]
            out.append(MatrixSpec(fqn, c.shape, built.muon_ns_steps, tuple(pc.rank for pc in c.pieces),
                                  tuple(pc.numel for pc in c.pieces), tuple(pc.nrows for pc in c.pieces),
                                  p.fqn if fqn != p.fqn else ""))
    return out


def muon_plan(built: Built, bucket_mib: float, specs: list | None = None) -> dict[str, Any]:
    """GefenMuon's step at this mesh: Newton-Schulz FLOPs of the busiest owner against the mean and
    against the serial sum (every rank waiting on every matrix, as before the owner-parallel step),
    exchange bytes and in-flight bytes per rank."""
    from gefen_titan.optim.muon import build_schedule
    from gefen_titan.optim.muon.schedule import exchange_bytes, owner_loads, rank_bytes
    from gefen_titan.optim.muon.stats import COPIES, SLOTS

    specs = muon_specs(built) if specs is None else specs
    sched = build_schedule(specs, int(bucket_mib * 2**20))
    loads = owner_loads(specs, sched)
    group = max(1, len(loads))
    costs = [m.cost for m in specs]
    per_bucket = [rank_bytes(specs, dict(zip(b.matrices, b.owners))) for b in sched.buckets]
    critical = 0  # buckets run one after another, each as long as its busiest owner
    for b in sched.buckets:
        load: dict[int, int] = defaultdict(int)
        for i, o in zip(b.matrices, b.owners):
            load[o] += specs[i].cost
        whole = load.pop(-1, 0)
        critical += max(load.values(), default=0) + whole
    live = max((max(a.get(r, 0) + b.get(r, 0) for r in set(a) | set(b))
                for a, b in zip(per_bucket, per_bucket[1:] + [{}])), default=0)
    return {"matrices": len(specs), "group": group, "buckets": len(sched.buckets),
            "busiest_flops": max(loads.values()), "mean_flops": sum(costs) / group, "largest_flops": max(costs),
            "serial_flops": sum(costs), "critical_flops": critical,
            "exchange_max": max(exchange_bytes(specs, sched).values(), default=0),
            "inflight_max": COPIES * live, "bound": SLOTS * COPIES * sched.limit_bytes, "bucket_mib": bucket_mib}


def _block_options() -> Any:
    """Gefen's options with the block second moment (the plan's default rows are the default's, factored)."""
    from gefen_titan.optim.kinds.gefen.options import GefenOptions

    return GefenOptions(second_moment="block")


def plan(built: Built, exact_items: int = 100_000, muon_bucket_mib: float | None = None) -> dict[str, Any]:
    chunks = Chunks()
    w = built.mesh.world
    row: dict[str, Any] = {"flavor": built.flavor, "mesh": built.mesh.name, "label": built.mesh.label, "world": w,
                           "numel": built.numel}
    row["gefen_state"] = max(state_bytes(built, "Gefen", "fallback"))  # the default's: factored
    row["gefen_state_block"] = max(state_bytes(built, "Gefen", "fallback", options=_block_options()))
    row["gefen_state_finest"] = max(state_bytes(built, "Gefen", "finest"))
    row["adamw_state"] = max(state_bytes(built, "AdamW"))
    for name, entries in (("gefen", optimizer_entries(built, "Gefen")), ("adamw", adamw_entries(built))):
        acc = account(entries, w, chunks)
        md = metadata_estimate(entries, w, chunks, built.checkpoint_id, acc.items, exact_items)
        row[name] = {"entries": acc.entries, "chunks": acc.chunks, "plan_items": acc.items,
                     "written_max": max(acc.bytes_per_rank), "written_total": sum(acc.bytes_per_rank),
                     "items_max": max(acc.items_per_rank), "metadata": md["metadata"], "gathered": md["gathered"],
                     "exact": md["exact"]}
    row["factored"] = scale_factored.factored_figures(built, state_bytes)
    coll = collectives(built)
    row["collectives"] = coll
    row["agreement_per_rank"] = sum(c["per_rank"] for c in coll)
    specs = muon_specs(built) if muon_bucket_mib is not None else None
    if specs is not None:
        row["muon"] = muon_plan(built, muon_bucket_mib, specs)
    if built.muon_fqns is not None:  # an MoE flavor

        row["moe"] = scale_moe.moe_figures(built, specs)
    return row


# ----------------------------------------------------------------- growth
def slope(points: dict[int, float]) -> float:
    """Least-squares slope of log(value) over log(W) (values must be > 0)."""
    xs = [math.log(w) for w in points]
    ys = [math.log(v) for v in points.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


# figure -> (how to read it from a row: per-rank value, job-wide value)
FIGURES = {
    "Gefen state / rank": (lambda r: r["gefen_state"], lambda r: r["gefen_state"] * r["world"]),
    "AdamW state / rank": (lambda r: r["adamw_state"], lambda r: r["adamw_state"] * r["world"]),
    "Gefen ckpt written / rank": (lambda r: r["gefen"]["written_max"], lambda r: r["gefen"]["written_total"]),
    "AdamW ckpt written / rank": (lambda r: r["adamw"]["written_max"], lambda r: r["adamw"]["written_total"]),
    "Gefen chunks": (lambda r: r["gefen"]["items_max"], lambda r: r["gefen"]["chunks"]),
    "AdamW chunks": (lambda r: r["adamw"]["items_max"], lambda r: r["adamw"]["chunks"]),
    "Gefen metadata (read by every rank)": (lambda r: r["gefen"]["metadata"],
                                            lambda r: r["gefen"]["metadata"] * r["world"]),
    "AdamW metadata (read by every rank)": (lambda r: r["adamw"]["metadata"],
                                            lambda r: r["adamw"]["metadata"] * r["world"]),
    "Gefen save gather at rank 0": (lambda r: r["gefen"]["gathered"], lambda r: r["gefen"]["gathered"]),
    "AdamW save gather at rank 0": (lambda r: r["adamw"]["gathered"], lambda r: r["adamw"]["gathered"]),
    "Gefen first-step agreement / rank": (lambda r: r["agreement_per_rank"],
                                          lambda r: r["agreement_per_rank"] * r["world"]),
}


def growth(rows: list[dict], per_rank, job) -> dict[str, float]:
    pr = {r["world"]: float(per_rank(r)) for r in rows}
    jb = {r["world"]: float(job(r)) for r in rows}
    return {"per_rank": slope(pr), "job": slope(jb)}


def flags(rows: list[dict]) -> list[dict]:
    """Growth of every figure per (flavor, mesh); ``flag`` where the job-wide figure grows faster than linearly."""
    out = []
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        groups[(r["flavor"], r["mesh"])].append(r)
    for (flavor, mesh), rs in groups.items():
        if len({r["world"] for r in rs}) < 2:
            continue
        figures = dict(FIGURES)
        if all(r.get("moe") for r in rs):
            figures.update(scale_moe.MOE_FIGURES)
        for name, (per_rank, job) in figures.items():
            g = growth(rs, per_rank, job)
            out.append({"flavor": flavor, "mesh": mesh, "figure": name, **g, "flag": g["job"] > FLAG_SLOPE})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| flavor | mesh | W | Gefen state/rank (finest) | AdamW state/rank | Gefen ckpt/rank | AdamW ckpt/rank "
             "| Gefen entries / chunks | AdamW entries / chunks | Gefen metadata | AdamW metadata | agreement/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, a = r["gefen"], r["adamw"]
        lines.append(
            f"| {r['flavor']} | {r['label']} | {r['world']} | {fmt_bytes(r['gefen_state'])} "
            f"({fmt_bytes(r['gefen_state_finest'])}) "
            f"| {fmt_bytes(r['adamw_state'])} | {fmt_bytes(g['written_max'])} | {fmt_bytes(a['written_max'])} "
            f"| {g['entries']:,} / {g['chunks']:,} | {a['entries']:,} / {a['chunks']:,} "
            f"| {'' if g['exact'] else '~'}{fmt_bytes(g['metadata'])} "
            f"| {'' if a['exact'] else '~'}{fmt_bytes(a['metadata'])} "
            f"| {fmt_bytes(r['agreement_per_rank'])} |")
    return "\n".join(lines)


def growth_table(found: list[dict]) -> str:
    by: dict[tuple, dict] = defaultdict(dict)
    for f in found:
        by[(f["flavor"], f["figure"])][f["mesh"]] = f
    meshes = list(dict.fromkeys(f["mesh"] for f in found))
    lines = ["| flavor | figure | " + " | ".join(f"{m}: per rank / job" for m in meshes) + " |",
             "|---|---|" + "---|" * len(meshes)]
    for (flavor, figure), ms in by.items():
        cells = []
        for m in meshes:
            f = ms.get(m)
            cells.append("" if f is None else
                         f"W^{f['per_rank']:+.2f} / W^{f['job']:.2f}" + (" **FLAG**" if f["flag"] else ""))
        lines.append(f"| {flavor} | {figure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(rows: list[dict], max_tp: int) -> list[dict]:
    """Print the tables; returns the growth figures."""
    found = flags(rows)
    print(f"\nOptimizer state and checkpoint per rank (worst rank), Gefen periods = the row unit (agreed blocking's "
          f"fallback; in brackets the finest period the rule allows), max_tensor_parallel_degree {max_tp}; "
          "~: metadata extrapolated over identical layers\n")
    print(table(rows))
    if found:
        print("\nGrowth with the world size W (least-squares slope of log(figure) over log(W)), per rank / whole job; "
              f"FLAG: the job-wide figure grows faster than linearly (slope > {FLAG_SLOPE})\n")
        print(growth_table(found))
        flagged = [f for f in found if f["flag"]]
        if flagged:
            print("\nflagged (faster than linear in W):")
            for f in flagged:
                print(f"  {f['flavor']} {f['mesh']}: {f['figure']}: per rank W^{f['per_rank']:+.2f}, "
                      f"job W^{f['job']:.2f}")
    dense = [r for r in rows if not r.get("moe")]
    if any(r.get("muon") for r in dense):
        mib = next(r["muon"]["bucket_mib"] for r in dense if r.get("muon"))
        print("\nGefenMuon's step per optimizer step (recipes/llama_gefen_muon.toml's hidden matrices, ns_steps "
              f"{MUON_NS_STEPS}, muon_bucket_mib {mib:g}): Newton-Schulz FLOPs of the busiest owner, against the "
              "mean over the group and the largest matrix; the buckets' busiest owners summed is the step's "
              "critical path (a bucket's returns are waited before the next computes); the serial sum is what "
              "every rank waited on before owners ran at once; exchange: sent + received by the busiest rank; in "
              "flight: two live buckets' bytes on the worst rank, one copy each (bound: 2 x 2 x the schedule's "
              "limit)\n")
        print(muon_table(dense))
    if any(r.get("moe") for r in rows):

        scale_moe.report_moe([r for r in rows if r.get("moe")])
    if rows:
        print("\nGefen's factored second moment (optimizer.gefen.second_moment = \"factored\"; "
              "benchmarks/scale_factored.py): state per rank (worst rank; block's beside it), and per step its "
              "row/column all-reduces against the gradient reduce-scatter (bf16), on the rank where the ratio is "
              "highest\n")
        print("| flavor | mesh | W | factored state/rank | block state/rank | factored collectives/rank/step "
              "| gradient reduce-scatter/rank/step | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            f = r["factored"]
            print(f"| {r['flavor']} | {r['label']} | {r['world']} | {fmt_bytes(f['state'])} "
                  f"| {fmt_bytes(r['gefen_state_block'])} | {fmt_bytes(f['collective'])} | {fmt_bytes(f['grad'])} "
                  f"| {100 * f['ratio']:.3f}% |")
        r = rows[-1]
        collectives = "; ".join(f"{c['what']} {c['op']} {c['numel']:,} x {c['dtype']} -> "
                                f"{fmt_bytes(c['per_rank'])}/rank" for c in r["collectives"])
        print(f"\nfirst-step collectives of the agreement ({r['flavor']}, {r['label']}): {collectives}; "
              f"total {fmt_bytes(r['agreement_per_rank'])} received per rank")
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavors", default=None,
                    help=f"default {','.join(SMALL['flavors'])} (--full: {','.join(FLAVORS)}; with --moe: "
                         f"{','.join(MOE_DEFAULT)}); MoE flavors: {', '.join(MOE_FLAVORS)}")
    ap.add_argument("--meshes", default=None,
                    help=f"default {','.join(SMALL['meshes'])} (--full: {','.join(MESHES)}; with --moe: ep); "
                         f"known: {', '.join(MESHES + MOE_MESHES)}")
    ap.add_argument("--worlds", default=None,
                    help=f"default {','.join(map(str, SMALL['worlds']))} (--full: {','.join(map(str, WORLDS))}; "
                         f"with --moe: {','.join(map(str, MOE_WORLDS))})")
    ap.add_argument("--full", action="store_true",
                    help="the whole dense plan: every flavor x mesh x world size above (~35 min on 2 cores)")
    ap.add_argument("--moe", action="store_true",
                    help="the mixture-of-experts plan: MoE flavors on ep meshes (benchmarks/scale_moe.py)")
    ap.add_argument("--ep", default=",".join(map(str, EP_DEGREES)), help="EP degrees of the ep meshes")
    ap.add_argument("--tp", type=int, default=8, help="TP degree of the fsdp_tp meshes")
    ap.add_argument("--hsdp-shard", type=int, default=8, help="shard degree of the hsdp meshes")
    ap.add_argument("--max-tp-degree", type=int, default=8,
                    help="optimizer.blocking.max_tensor_parallel_degree of every run (periods fit TP degrees "
                         "dividing it)")
    ap.add_argument("--exact-items", type=int, default=100_000,
                    help="build the metadata in full up to this many plan items, else extrapolate over layers")
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--second-moment", default=None, choices=("auto", "block", "factored"),
                    help="Gefen's optimizer.gefen.second_moment over the recipe's (default: the recipe's; the "
                         "recipes leave it at auto: factored)")
    ap.add_argument("--muon-bucket-mib", type=float, default=None,
                    help="optimizer.muon.bucket_mib of the GefenMuon rows (default: its default)")
    ap.add_argument("--no-muon", action="store_true", help="leave out the GefenMuon rows")
    ap.add_argument("--json", default="", help="also write every figure here")
    ap.add_argument("--from-json", default="", help="print the tables of an earlier --json run (builds nothing)")
    args = ap.parse_args(argv)
    if args.muon_bucket_mib is None:
        from gefen_titan.optim.muon import DEFAULT_BUCKET_MIB

        args.muon_bucket_mib = DEFAULT_BUCKET_MIB
    if not args.muon_bucket_mib > 0:
        ap.error("--muon-bucket-mib must be > 0")
    if args.full and args.moe:
        ap.error("--full is the dense plan; --moe has its own defaults")
    args.defaulted = not (args.full or args.moe) and args.flavors is None and args.meshes is None \
        and args.worlds is None
    dense = (FLAVORS, MESHES, WORLDS) if args.full else (SMALL["flavors"], SMALL["meshes"], SMALL["worlds"])
    flavors = args.flavors if args.flavors is not None else ",".join(MOE_DEFAULT if args.moe else dense[0])
    meshes = args.meshes if args.meshes is not None else ",".join(MOE_MESHES if args.moe else dense[1])
    worlds = args.worlds if args.worlds is not None else ",".join(map(str, MOE_WORLDS if args.moe else dense[2]))
    args.flavors = [f for f in flavors.split(",") if f]
    args.meshes = [m for m in meshes.split(",") if m]
    bad = [m for m in args.meshes if m not in MESHES + MOE_MESHES]
    if bad:
        ap.error(f"--meshes: unknown {', '.join(bad)} (known: {', '.join(MESHES + MOE_MESHES)})")
    try:
        args.worlds = sorted({int(w) for w in worlds.split(",") if w})
        args.ep = sorted({int(e) for e in args.ep.split(",") if e})
    except ValueError:
        ap.error(f"--worlds, --ep: expected comma-separated integers, got {worlds!r}, {args.ep!r}")
    if not args.worlds or min(args.worlds) < 1 or args.tp < 1 or args.hsdp_shard < 1 or not args.ep \
            or min(args.ep) < 1:
        ap.error("--worlds, --ep, --tp and --hsdp-shard must be >= 1")
    dense_ep = [f for f in args.flavors if f not in MOE_FLAVORS] if "ep" in args.meshes else []
    if dense_ep:
        ap.error(f"--meshes ep: {', '.join(dense_ep)} has no experts (MoE flavors: {', '.join(MOE_FLAVORS)})")
    return args


def meshes(args: argparse.Namespace) -> list[Mesh]:
    """Every mesh of the run, in the tables' order (per kind, per EP degree, per world size)."""
    out = []
    for kind in args.meshes:
        for ep in args.ep if kind == "ep" else [1]:
            for world in args.worlds:
                try:
                    out.append(mesh_for(kind, world, args.tp, args.hsdp_shard, ep))
                except ValueError as e:
                    print(f"skip: {e}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        return report(saved["rows"], saved["args"]["max_tp_degree"])
    from torchtitan.tools.logging import logger

    from gefen_titan import patches
    from gefen_titan.checkpoint import progress
    from gefen_titan.recipe import flavors

    patches.apply_all()  # torchtitan's parallelize on CPU (the meta device, a fake process group)
    flavors.register_flavors()

    logger.setLevel("WARNING")
    rows = []
    cells = [(flavor, mesh) for flavor in args.flavors for mesh in meshes(args)]
    # Said first: a cell of 405B at 1024 ranks takes minutes, and nothing else prints before it is done.
    print(f"plan: {', '.join(args.flavors)} x {', '.join(args.meshes)} x {', '.join(map(str, args.worlds))} ranks: "
          f"{len(cells)} cell{'s' if len(cells) != 1 else ''}"
          + ("; without flags a small plan (--full: every flavor, mesh and size, ~35 min on 2 cores)"
             if args.defaulted else ""), file=sys.stderr, flush=True)
    with progress.bar(len(cells), "plan", unit="cell") as bar:
        for flavor, mesh in cells:
            bar.set_postfix_str(f"{flavor} {mesh.label}")
            begin = time.monotonic()
            built = build(flavor, mesh, args.max_tp_degree, args.recipe, args.second_moment)
            row = plan(built, args.exact_items, None if args.no_muon else args.muon_bucket_mib)
            rows.append(row)
            bar.write(f"done: {flavor} {mesh.label} ({time.monotonic() - begin:.1f} s)", file=sys.stderr)
            bar.update()
    found = report(rows, args.max_tp_degree)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "growth": found}, indent=1,
                                              default=str))


if __name__ == "__main__":
    main()
