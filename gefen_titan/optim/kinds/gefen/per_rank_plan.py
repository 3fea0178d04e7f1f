"""Format v1's load plan: the live slots, the source ranks' records that cover them, checked.

Part of Gefen's per-rank adapter (``per_rank``): before DCP reads, every rank
parses the v1 records of the checkpoint's small read, checks them (each
parameter's hyperparameters and counters, every source rank's codebook, the
source shards tiling each parameter, one step count) and plans which source
ranks' shards overlap its own. Everyone reads the same bytes, so every rank
reaches the same verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

from gefen_titan.checkpoint.errors import GefenCheckpointError, other_model_advice
from gefen_titan.checkpoint.format import schema, schema_records
from gefen_titan.distributed import local
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.optim.kinds.gefen import records_v1
from gefen_titan.optim.kinds.gefen.per_rank_regions import Region

__all__ = ["Slot", "Source", "Plan", "check_keys", "plan_from_records"]


@dataclass
class Slot:
    """One live Gefen parameter on this rank."""

    fqn: str
    param: torch.Tensor
    optim: Optimizer
    opt_id: str
    group: dict
    region: Region
    local_shape: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return local(self.param).device


@dataclass
class Source:
    """One source rank's record of one parameter (from the checkpoint)."""

    label: int
    start: int
    length: int
    period: int
    step: int
    vmean_step: int
    opt_id: str
    block0: int = 0  # first row of this parameter in the source rank's blocks

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass
class Plan:
    params: dict[str, dict]  # fqn -> checkpoint param record
    sources: dict[str, list[Source]]  # fqn -> source records, by start
    codebooks: dict[tuple[str, int], torch.Tensor]
    global_steps: dict[tuple[str, int], int]
    block_rows: dict[tuple[str, int], int]  # (opt, rank) -> rows of its blocks entry
    needed: dict[str, list[Source]] = field(default_factory=dict)  # fqn -> overlapping


def check_keys(slots: list[Slot], ours: dict[str, Any]) -> str | None:
    """Why the checkpoint's entries (``ours``: names inside ``optimizer.`` -> metadata) cannot hold these
    slots' v1 state: no Gefen state, a live parameter without codes, codes of another shape (None: they can)."""
    if not slots:
        return None
    parsed = [schema.parse_key(k) for k in ours]
    saved = {pk.name for pk in parsed if pk and pk.kind == "codes"}
    if schema.header_key() not in ours or not saved:
        foreign = sorted(k for k in ours if k.startswith("state."))[:3]
        what = (
            f"it holds another optimizer's state ({', '.join(foreign)} ...)"
            if foreign
            else "it holds no Gefen state in the gefen-titan format"
        )
        return (
            f"{what}. To start Gefen fresh from this checkpoint's model, set "
            "checkpoint.exclude_from_loading = [\"optimizer\"] (and lr_scheduler if needed)"
        )
    live = {s.fqn for s in slots}
    missing = sorted(live - saved)
    if missing:
        return other_model_advice(
            f"it has no Gefen state for {len(missing)} live parameter(s) "
            f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})"
        )
    for s in slots:
        codes = ours.get(gefen_keys.codes_key(s.fqn))
        if codes is None:
            return f"{s.fqn}: codes missing from the checkpoint (truncated or foreign checkpoint)"
        if tuple(codes.size) != tuple(s.param.shape):
            return other_model_advice(f"{s.fqn} is {tuple(codes.size)} there and {tuple(s.param.shape)} here")
    return None

def plan_from_records(slots: list[Slot], small: dict[str, Any], ours: dict[str, Any]) -> Plan:
    """This rank's load plan from the v1 records (``small``: the load's small read) and the entries: every
    record checked (hyperparameters, counters, codebooks, source shards tiling each parameter), and for each
    slot the source ranks whose shards overlap it. GefenCheckpointError names the first problem."""
    # Every saved parameter: which optimizer, its index there, its record.
    where: dict[str, tuple[str, int, records_v1.V1ParamRecord, int, int]] = {}
    for key, value in small.items():
        pk = schema.parse_key(key)
        if pk and pk.kind == "gefen":
            meta = records_v1.V1OptimizerRecord.from_json(value, pk.name)
            for i, rec in enumerate(meta.params):
                where[rec.fqn] = (pk.name, i, rec, meta.nshards, len(meta.params))
    params, sources = {}, {}
    codebooks, global_steps, block_rows = {}, {}, {}
    for slot in slots:
        if slot.fqn not in where:
            raise GefenCheckpointError(
                f"{slot.fqn}: no record in the checkpoint (another model or optimizer grouping)")
        opt_id, index, rec, nshards, nparams = where[slot.fqn]
        params[slot.fqn] = rec
        gefen_records.check_hyper(slot.fqn, rec.group)
        srcs = []
        for label in range(nshards):
            rk = gefen_keys.records_key(opt_id, label)
            if rk not in small:
                raise GefenCheckpointError(
                    f"{slot.fqn}: records of source rank {label} missing (truncated checkpoint?)")
            global_step, table = records_v1.read_v1_rank_table(small[rk], nparams, rk)
            row = table[index]
            bk = ours.get(gefen_keys.blocks_key(opt_id, label))
            rows = bk.size[0] if bk is not None else -1
            block_rows[(opt_id, label)] = rows
            why = row.check(slot.fqn, label, rows) or gefen_records.check_counters(
                f"{slot.fqn}: source rank {label}", row.period, row.step, row.vmean_step)
            if why:
                raise GefenCheckpointError(why)
            srcs.append(Source(label, row.start, row.length, row.period, row.step, row.vmean_step, opt_id,
                                row.block0))
            key = (opt_id, label)
            global_steps.setdefault(key, global_step)
            if global_steps[key] < row.step:
                raise GefenCheckpointError(
                    f"{slot.fqn}: global step {global_steps[key]} < parameter step {row.step}")
            if row.period and key not in codebooks:
                ck = gefen_keys.rank_codebook_key(*key)
                if ck not in small:
                    raise GefenCheckpointError(f"codebook of source rank {label} for optimizer {opt_id} missing")
                codebooks[key] = schema_records.check_codebook(small[ck],
                                                               f"codebook of source rank {label} ({opt_id})")
        srcs.sort(key=lambda s: s.start)
        pos = 0
        for src in srcs:
            if src.length and src.start != pos:
                raise GefenCheckpointError(
                    f"{slot.fqn}: source shards do not tile the parameter (gap or overlap at element {pos})")
            pos = src.stop if src.length else pos
        if pos != slot.param.numel():
            raise GefenCheckpointError(f"{slot.fqn}: source shards cover {pos} of {slot.param.numel()} elements")
        steps = {src.step for src in srcs if src.length}
        if len(steps) > 1:
            raise GefenCheckpointError(f"{slot.fqn}: source ranks disagree on the step count {sorted(steps)}")
        sources[slot.fqn] = srcs
    plan = Plan(params, sources, codebooks, global_steps, block_rows)
    for slot in slots:
        r = slot.region
        plan.needed[slot.fqn] = [
            src for src in sources[slot.fqn]
            if src.length and src.period and src.start < r.stop and r.start < src.stop
        ]
    return plan
