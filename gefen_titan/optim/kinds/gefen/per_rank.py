"""Save Gefen state compactly and load it at any data-parallel degree.

The adapter sits behind ``GefenOptimizersContainer.state_dict()`` /
``load_state_dict()``. Saving hands DCP the state as it is (the v1 records: ``checkpoint/format/records_v1.py``).
Loading is two-phase because Gefen's per-rank state differs in size:

1. ``prepare_load`` (all ranks, before torchtitan's ``dcp.load``) takes the
   checkpoint's small records (formats, layouts, codebooks; a few KB per
   rank, read once for every kind: ``LoadContext``) and checks them against the live model. Everyone reads the same
   bytes, so every rank reaches the same verdict and raises the same error.
   It then plans this rank's target state: which source ranks overlap its
   shard, and for each parameter whether the source blocks can be adopted.
2. torchtitan's ``dcp.load`` asks ``state_dict()`` for destinations: fresh
   buffers for the codes (with the *live* placements, so DCP reshards them
   element-wise) and for the block records of the overlapping source ranks.
   ``load_state_dict`` checks those values, builds the new state aside, and
   commits on every rank only once all ranks agree; a failure anywhere leaves
   every live optimizer untouched.

Exactness: a target shard that lies on whole blocks of one source rank, on an
optimizer whose params all come from that rank, adopts codebook, period,
magnitudes and ``vmean`` unchanged (same world size, 1->2, 2->4, ...). Other
shards (merges, uneven splits) are dequantized, re-blocked so each target
block lies inside one source block where memory allows, and requantized once
against a codebook merged from the sources' codebooks weighted by use.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import torch
from torch.optim import Optimizer

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import kinds, schema, schema_records
from gefen_titan.distributed import like_param, local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.checkpointing.adapter import StagedLoad, blocking_refusal
from gefen_titan.optim.checkpointing.codebook_merge import K, merge_codebooks
from gefen_titan.optim.checkpointing.load_context import LoadContext
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records_v1
from gefen_titan.optim.kinds.gefen.keys import HYPER
from gefen_titan.optim.kinds.gefen.per_rank_plan import Plan, Slot, check_keys, plan_from_records
from gefen_titan.optim.kinds.gefen.per_rank_regions import Region, UnsupportedLayout, param_region, target_period
from gefen_titan.optim.quant.requant import Segment, block_mean_segments, dequantize_segments, requantize

__all__ = ["GefenPerRankAdapter"]


class GefenPerRankAdapter(StagedLoad):
    """Format v1: each rank's own codebook and periods (``optimizer.blocking.mode = "per_rank"``)."""

    kind = "Gefen"
    formats = (schema.V1,)

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.optimizers = [o for o in optimizers if gx.is_gefen(o)]
        self.slots: list[Slot] = []
        # A layout we cannot checkpoint (TP shards) must not stop training
        # without checkpoints: refuse at save/load time instead.
        self._unsupported: str | None = None
        for optim in self.optimizers:
            opt_id = schema.optimizer_id([n for n, _, _ in gx.named_params(optim)])
            for name, p, group in gx.named_params(optim):
                try:
                    region, local_shape = param_region(name, p)
                except UnsupportedLayout as e:
                    self._unsupported = self._unsupported or str(e)
                    region, local_shape = Region(0, 1, 0, p.numel()), tuple(p.shape)
                self.slots.append(Slot(name, p, optim, opt_id, group, region, local_shape))

    # ------------------------------------------------------------------ save
    def _save(self) -> dict[str, Any]:
        if not self.slots:
            return {}
        if self._unsupported:
            raise GefenCheckpointError(f"cannot checkpoint Gefen state: {self._unsupported}")
        sd: dict[str, Any] = {schema.header_key(): schema_records.Header.for_blocking("per_rank").to_json()}
        for optim in self.optimizers:
            sd.update(self._save_optimizer(optim))
        return sd

    def _save_optimizer(self, optim: Optimizer) -> dict[str, Any]:
        slots = [s for s in self.slots if s.optim is optim]
        opt_id, label = slots[0].opt_id, slots[0].region.label
        device = slots[0].device
        out: dict[str, Any] = {}
        meta = records_v1.V1OptimizerRecord(slots[0].region.nshards, [])
        rows: list[records_v1.V1RankRow] = []
        blocks, nblocks = [], 0
        for slot in slots:
            try:
                st = gx.gefen_read(slot.optim, slot.param)
            except ValueError as e:
                raise GefenCheckpointError(f"{slot.fqn}: {e}") from e
            meta.params.append(records_v1.V1ParamRecord(slot.fqn, tuple(slot.param.shape),
                                                    {k: float(slot.group[k]) for k in HYPER}))
            r = slot.region
            if st is not None:
                # Clones: an async save writes after the next step has
                # mutated the state in place.
                codes = st.codes.reshape(slot.local_shape).clone()
                b = torch.cat([st.magnitude.reshape(-1, 1), st.vmean.reshape(-1, 1)], 1).float()
                period, step, vstep = st.period, st.step, st.vmean_step
            else:
                codes = torch.zeros(slot.local_shape, dtype=torch.uint8, device=device)
                b = torch.zeros(0, 2, dtype=torch.float32, device=device)
                period, step, vstep = 0, 0, 0
            rows.append(records_v1.V1RankRow(r.start, r.length, period, step, vstep, nblocks, b.shape[0]))
            blocks.append(b)
            nblocks += b.shape[0]
            out[gefen_keys.codes_key(slot.fqn)] = like_param(slot.param, codes, tuple(slot.param.shape))
        out[gefen_keys.optimizer_key(opt_id)] = meta.to_json()
        out[gefen_keys.records_key(opt_id, label)] = records_v1.v1_rank_table(gx.global_step(optim), rows)
        out[gefen_keys.blocks_key(opt_id, label)] = torch.cat(blocks).to(device)
        if gx.codebook(optim) is not None:
            out[gefen_keys.rank_codebook_key(opt_id, label)] = gx.codebook(optim).detach().float().clone()
        return out

    # ------------------------------------------------------------------ load
    def _format_refusal(self, header: schema_records.Header) -> str:
        return blocking_refusal(header, "per_rank")

    def _plan_from(self, ctx: LoadContext) -> Plan:
        why = self._unsupported or check_keys(self.slots, ctx.entries)
        if why:
            raise GefenCheckpointError(why)
        return plan_from_records(self.slots, ctx.small, ctx.entries)  # (UnsupportedLayout is a ValueError)

    def _load_destinations(self, plan: Plan) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for slot in self.slots:
            if not plan.needed[slot.fqn]:
                continue
            dest = torch.empty(slot.local_shape, dtype=torch.uint8, device=slot.device)
            sd[gefen_keys.codes_key(slot.fqn)] = like_param(slot.param, dest, tuple(slot.param.shape))
            for src in plan.needed[slot.fqn]:
                key = gefen_keys.blocks_key(src.opt_id, src.label)
                if key not in sd:  # a source rank's blocks of the whole optimizer, read once
                    rows = plan.block_rows[(src.opt_id, src.label)]
                    sd[key] = torch.empty(rows, 2, dtype=torch.float32, device=slot.device)
        return sd

    def _stage(self, plan: Plan, sd: dict[str, Any]) -> dict:
        return self._build(plan, sd)

    def _build(self, plan: Plan, sd: dict[str, Any]) -> dict:
        """New per-param states and per-optimizer codebooks, nothing committed."""
        codes_of: dict[str, torch.Tensor] = {}
        blocks_of: dict[tuple[str, int], torch.Tensor] = {}
        for slot in self.slots:
            if not plan.needed[slot.fqn]:
                continue
            codes_of[slot.fqn] = local(sd[gefen_keys.codes_key(slot.fqn)]).reshape(-1)
            for s in plan.needed[slot.fqn]:
                b = sd[gefen_keys.blocks_key(s.opt_id, s.label)][s.block0 : s.block0 + s.length // s.period]
                why = kinds.nonnegative_problem(b)  # verify's check of them too
                if why:
                    raise GefenCheckpointError(f"{slot.fqn}: source rank {s.label} has non-finite or negative "
                                               f"magnitudes/vmean ({why}; corrupt checkpoint)")
                blocks_of[(slot.fqn, s.label)] = b

        # One codebook per live optimizer: adopt it when all of the optimizer's
        # elements on this rank come from one source codebook, else merge.
        per_optim: dict[int, Counter] = defaultdict(Counter)
        for slot in self.slots:
            r = slot.region
            for s in plan.needed[slot.fqn]:
                per_optim[id(slot.optim)][(s.opt_id, s.label)] += min(r.stop, s.stop) - max(r.start, s.start)
        codebooks: dict[int, tuple[torch.Tensor, tuple | None]] = {}
        for optim in self.optimizers:
            used = per_optim.get(id(optim))
            if not used:
                continue
            device = next(s.device for s in self.slots if s.optim is optim)
            if len(used) == 1:
                (key,) = used
                codebooks[id(optim)] = (plan.codebooks[key].to(device), key)
            else:
                codebooks[id(optim)] = (self._merged_codebook(plan, optim, codes_of).to(device), None)

        states: dict[str, dict] = {}
        for slot in self.slots:
            if plan.needed[slot.fqn]:
                cb, adopted = codebooks[id(slot.optim)]
                states[slot.fqn] = self._build_slot(plan, slot, codes_of[slot.fqn], blocks_of, cb, adopted)
        optim_meta = {}
        for optim in self.optimizers:
            if id(optim) in codebooks:
                cb, _ = codebooks[id(optim)]
                keys = per_optim[id(optim)]
                optim_meta[id(optim)] = (cb, max(plan.global_steps[k] for k in keys))
        return {"states": states, "optim": optim_meta}

    def _merged_codebook(self, plan: Plan, optim: Optimizer, codes_of: dict[str, torch.Tensor]) -> torch.Tensor:
        codebooks, weights = [], []
        for slot in self.slots:
            if slot.optim is not optim:
                continue
            r = slot.region
            codes = codes_of.get(slot.fqn)
            for s in plan.needed[slot.fqn]:
                lo, hi = max(r.start, s.start), min(r.stop, s.stop)
                use = torch.bincount(codes[lo - r.start : hi - r.start].long(), minlength=K).double().cpu()
                codebooks.append(plan.codebooks[(s.opt_id, s.label)].double().cpu())
                weights.append(use)
        return merge_codebooks(codebooks, weights)

    def _build_slot(self, plan, slot, codes, blocks_of, cb, adopted) -> dict:
        r = slot.region
        srcs = plan.needed[slot.fqn]
        step = max(s.step for s in srcs)
        vstep = max(s.vmean_step for s in srcs)
        if len(srcs) == 1:
            s = srcs[0]
            aligned = (s.start <= r.start and r.stop <= s.stop and (r.start - s.start) % s.period == 0
                       and (r.stop - s.start) % s.period == 0)
            if aligned and adopted == (s.opt_id, s.label):
                b = blocks_of[(slot.fqn, s.label)]
                j0, j1 = (r.start - s.start) // s.period, (r.stop - s.start) // s.period
                return {
                    "automatic_period": s.period,
                    "step": step,
                    "vmean_step": vstep,
                    "m_codebook": codes.reshape(-1, s.period).clone(),
                    "m_magnitude": b[j0:j1, 0:1].clone(),
                    "vmean": b[j0:j1, 1:2].clone(),
                }
        period, _ = target_period(r.start, r.length, [(s.start, s.period) for s in srcs])
        # The sources' overlaps tile this shard in order: one segment each, one kernel launch for all.
        segments = []
        for s in srcs:
            lo, hi = max(r.start, s.start), min(r.stop, s.stop)
            b = blocks_of[(slot.fqn, s.label)]
            src_cb = plan.codebooks[(s.opt_id, s.label)].to(codes.device)
            segments.append(Segment(hi - lo, s.period, lo - s.start, src_cb, b[:, 0], b[:, 1]))
        new_codes, magnitude = requantize(dequantize_segments(codes, segments), cb, period)
        return {
            "automatic_period": period,
            "step": step,
            "vmean_step": vstep,
            "m_codebook": new_codes,
            "m_magnitude": magnitude,
            # Exact (the source block's value) where a target block lies in one source block.
            "vmean": block_mean_segments(segments, period),
        }

    def _commit(self, plan: Plan, staged: dict) -> None:
        for slot in self.slots:
            new = staged["states"].get(slot.fqn)
            gx.gefen_write(slot.optim, slot.param, None if new is None else gx.GefenParamState(
                period=new["automatic_period"], step=new["step"], vmean_step=new["vmean_step"],
                codes=new["m_codebook"].contiguous(), magnitude=new["m_magnitude"].contiguous(),
                vmean=new["vmean"].contiguous()))
            hyper = plan.params[slot.fqn].group
            for k in HYPER:
                slot.group[k] = hyper[k]
        for optim in self.optimizers:
            # No saved state for any of its params (a checkpoint written before
            # the first step): back to a fresh optimizer, which learns its
            # codebook on its next step.
            cb, global_step = staged["optim"].get(id(optim), (None, 0))
            gx.set_codebook(optim, cb)
            gx.set_global_step(optim, global_step)
