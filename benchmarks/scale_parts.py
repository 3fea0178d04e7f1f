"""The scale plan's shared pieces: its meshes, parameters and built models, the chunk tables of a
layout, the GefenMuon test, and the figures' units and Muon table.

``benchmarks.scale`` (the dense plan and the report) and ``benchmarks.scale_moe`` (the
mixture-of-experts rows) both build on these; neither imports the other's internals, and the
report imports the MoE module, never the other way round.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Built", "Chunks", "LAYER", "MUON_NS_STEPS", "MUON_PATTERN", "Mesh", "Param", "fmt_bytes", "fmt_flops",
           "is_muon", "muon_table"]


LAYER = re.compile(r"(^|[./])layers\.(\d+)\.")


# ----------------------------------------------------------------- meshes
@dataclass(frozen=True)
class Mesh:
    kind: str
    world: int
    tp: int = 1
    replicate: int = 1
    ep: int = 1

    @property
    def shard(self) -> int:
        return self.world // (self.tp * self.replicate)

    @property
    def name(self) -> str:
        """The mesh's series for the growth figures (one per EP degree)."""
        return f"ep{self.ep}" if self.kind == "ep" else self.kind

    @property
    def label(self) -> str:
        if self.kind == "ep":
            return f"EP {self.ep} x efsdp {self.shard // self.ep}"
        if self.kind == "fsdp_tp":
            return f"FSDP {self.shard} x TP {self.tp}"
        if self.kind == "hsdp":
            return f"HSDP {self.replicate} x {self.shard}"
        return f"FSDP {self.shard}"

    def parallelism(self) -> dict[str, int]:
        out = {"data_parallel_shard_degree": self.shard, "data_parallel_replicate_degree": self.replicate,
               "tensor_parallel_degree": self.tp}
        if self.kind == "ep":
            out["expert_parallel_degree"] = self.ep
        return out


# ------------------------------------------------------------------ model
@dataclass
class Param:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple
    mesh_shape: tuple[int, ...]
    coords: list[tuple[int, ...]]  # rank -> coordinate in the parameter's mesh
    unit: int  # 0: period 1 by Gefen's rules
    candidates: list[int]
    tensor: Any = field(default=None, repr=False, compare=False)  # the (meta) parameter: its mesh for the layout

    @property
    def layer(self) -> int | None:
        m = LAYER.search(self.fqn)
        return int(m.group(2)) if m else None

    def period(self, rule: str) -> int:
        if not self.unit:
            return 1
        if rule == "fallback":
            return self.unit if self.unit >= 8 else 1
        if rule == "finest":
            return next((c for c in self.candidates if c >= 8), self.unit if self.unit >= 8 else 1)
        raise ValueError(f"unknown period rule {rule!r}")


@dataclass
class Built:
    flavor: str
    mesh: Mesh
    numel: int
    params: list[Param]
    checkpoint_id: str
    adamw_template: list[tuple[str, str, Any]]  # (key pattern with {fqn}, kind, dtype or value)
    gefen_hyper: dict[str, float]
    deterministic: bool
    # Gefen's options table as the recipe (and --second-moment) built it, its second moment resolved
    # ("block" or "factored"): what the plan's Gefen state and entries follow.
    gefen_options: Any = None
    # GefenMuon's matrices: the FQNs GefenMuonHybrid routes to it (MoE flavors: the hidden matrices and the
    # routed experts) and its Newton-Schulz steps; None: the muon recipe's pattern (MUON_PATTERN, dense).
    muon_fqns: frozenset[str] | None = None
    muon_ns_steps: int = 5  # MUON_NS_STEPS


class Chunks:
    """Every rank's chunk (sizes, offsets) of a DTensor layout, cached by layout."""

    def __init__(self) -> None:
        self._tables: dict[Any, list[tuple[tuple, tuple]]] = {}

    def per_rank(self, shape: tuple[int, ...], param: Param) -> list[tuple[tuple, tuple]]:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        key = (shape, param.placements, param.mesh_shape, id(param.coords))
        if key not in self._tables:
            by_coord: dict[tuple, tuple] = {}
            table = []
            for coord in param.coords:
                if coord not in by_coord:
                    sizes, offsets = _compute_local_shape_and_global_offset(
                        shape, param.mesh_shape, list(coord), param.placements)
                    by_coord[coord] = (tuple(sizes), tuple(offsets))
                table.append(by_coord[coord])
            self._tables[key] = table
        return self._tables[key]

    def groups(self, shape: tuple[int, ...], param: Param) -> list[tuple[tuple, list[int], list[tuple]]]:
        """(offsets, ranks holding a chunk there ascending, their chunk sizes) per distinct chunk offset."""
        key = ("g", shape, param.placements, param.mesh_shape, id(param.coords))
        if key not in self._tables:
            by: dict[tuple, list] = {}
            for r, (sizes, offsets) in enumerate(self.per_rank(shape, param)):
                g = by.get(offsets)
                if g is None:
                    by[offsets] = g = [[], []]
                g[0].append(r)
                g[1].append(sizes)
            self._tables[key] = [(offsets, ranks, sizes) for offsets, (ranks, sizes) in by.items()]
        return self._tables[key]  # type: ignore[return-value]


# recipes/llama_gefen_muon.toml's GefenMuon group: the hidden matrices.
MUON_PATTERN = re.compile(r"^layers\.\d+\.(attention|feed_forward)\.")


MUON_NS_STEPS = 5  # the recipe's (gefen-x's default)


def is_muon(built: Built, p: Param) -> bool:
    """A GefenMuon parameter of the plan (``Built.muon_fqns``, or the muon recipe's pattern)."""
    if built.muon_fqns is not None:
        return p.fqn in built.muon_fqns
    return len(p.shape) == 2 and bool(MUON_PATTERN.match(p.fqn))


# ----------------------------------------------------------------- report
def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if n / size < 100 else f"{n / size:,.0f} {unit}"
    return f"{n:.0f} B"


def fmt_flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} FLOP"


def muon_table(rows: list[dict]) -> str:
    lines = ["| flavor | mesh | W | matrices / group / buckets | busiest owner NS | mean | largest matrix "
             "| busiest / max(largest, 1.1 x mean) | buckets' busiest, summed | serial sum (before) "
             "| exchange/rank/step | in flight/rank (bound) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.get("muon")
        if not m:
            continue
        target = max(m["largest_flops"], 1.1 * m["mean_flops"])
        lines.append(
            f"| {r['flavor']} | {r['label']} | {r['world']} | {m['matrices']} / {m['group']} / {m['buckets']} "
            f"| {fmt_flops(m['busiest_flops'])} | {fmt_flops(m['mean_flops'])} | {fmt_flops(m['largest_flops'])} "
            f"| {m['busiest_flops'] / target:.2f} | {fmt_flops(m['critical_flops'])} | {fmt_flops(m['serial_flops'])} "
            f"| {fmt_bytes(m['exchange_max'])} "
            f"| {fmt_bytes(m['inflight_max'])} ({fmt_bytes(m['bound'])}) |")
    return "\n".join(lines)
