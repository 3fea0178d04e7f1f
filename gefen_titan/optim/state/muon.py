"""GefenMuon's state in the checkpoint (formats v2 and v3: the same keys), resharded by DCP alone.

Under agreed blocking every rank holds the job's one GefenMuon codebook and
the same period per parameter, and the sharded step
(``gefen_titan.optim.muon``) keeps each rank's momentum on its shard of the
parameter: the codes are the shard's elements, the magnitudes its block
grid, NorMuon's rows its rows. Saving hands DCP views of them as DTensors
with the parameter's placements (the rows on ``[rows]``, placed like dim 0);
loading asks DCP for the live placements and installs what it read, so a
resume at any FSDP / TP / HSDP / pipeline layout is bit-exact and nothing is
requantized.

As for Gefen (``state.agreed``): ``prepare_load`` reads the small records,
checks them against the live model and layout on every rank alike, and
fixes the destinations; ``stage_load`` checks the values read and agrees on
every rank; ``commit_load`` installs them (``staging``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gefen_titan.checkpoint import schema
from gefen_titan.checkpoint.errors import GefenCheckpointError, refuse_on_any_rank
from gefen_titan.checkpoint.schema import grid_shape
from gefen_titan.checkpoint.schema_muon import (
    MuonOptimizerRecord,
    MuonParamRecord,
    check_muon_counters,
    check_muon_hyper,
    muon_tensor_specs,
)
from gefen_titan.distributed import like_param, like_param_rows, local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.blocking import check_period_fits
from gefen_titan.optim.state.staging import AgreedAdapter

__all__ = ["MuonStateAdapter"]

_WHAT = "cannot load GefenMuon optimizer state from"


@dataclass
class _Plan:
    checkpoint_id: str
    records: dict[str, MuonParamRecord]
    codebook: torch.Tensor | None
    global_steps: dict[str, int]  # saved opt id -> global step
    source_opt: dict[str, str]  # fqn -> saved opt id


class MuonStateAdapter(AgreedAdapter):
    """The ``StateAdapter`` of the GefenMuon optimizers of one rank (formats v2 and v3)."""

    kind = "GefenMuon"
    owns = staticmethod(gx.is_gefen_muon)
    record_kind, codebook_kind = "muon", "muon_codebook"

    # ------------------------------------------------------------------ save
    def _save_entries(self) -> dict[str, Any]:
        if not self.slots:
            return {}
        sd: dict[str, Any] = {schema.header_key(): schema.Header.for_blocking("agreed").to_json()}
        books = [b for b in (gx.codebook(o) for o in self.optimizers) if b is not None]
        if any(not torch.equal(books[0].cpu(), b.cpu()) for b in books[1:]):
            raise GefenCheckpointError(
                "the GefenMuon optimizers of this rank hold different codebooks; agreed blocking gives "
                "the job one GefenMuon codebook (was state loaded or edited outside gefen_titan?)")
        copy = (lambda t: t.clone()) if self.snapshot_on_save else (lambda t: t)
        for optim in self.optimizers:
            slots = [s for s in self.slots if s.optim is optim]
            params = []
            for s in slots:
                st = gx.muon_read(optim, s.param)
                shape = tuple(s.param.shape)
                if st is None:
                    params.append(MuonParamRecord(s.fqn, shape, 0, 0, 0, s.group))
                    continue
                params.append(MuonParamRecord(s.fqn, shape, st.period, st.step, st.rows_step, s.group))
                local_shape = tuple(s.local.shape)
                keys = schema.muon_tensor_keys(s.fqn)
                sd[keys["codes"]] = like_param(s.param, copy(st.codes.view(local_shape)), shape)
                sd[keys["magnitude"]] = like_param(s.param, copy(st.magnitude.view(grid_shape(local_shape, st.period))),
                                                   grid_shape(shape, st.period))
                if st.rows is not None:
                    sd[keys["rows"]] = like_param_rows(s.param, copy(st.rows.view(-1)))
            opt_id = slots[0].opt_id
            record = MuonOptimizerRecord(gx.muon_deterministic(optim), gx.global_step(optim), params)
            sd[schema.muon_optimizer_key(opt_id)] = record.to_json()
            if books:
                sd[schema.muon_codebook_key(opt_id)] = books[0].detach().float().cpu().clone()
        return sd

    # ------------------------------------------------------------------ load
    def _plan_from(self, checkpoint_id, small, ours, rec_keys, books, version) -> _Plan:
        records, source_opt, global_steps, deterministic = {}, {}, {}, {}
        for key in rec_keys:
            opt_id = schema.parse_key(key).name
            rec = MuonOptimizerRecord.from_json(small[key], opt_id)
            global_steps[opt_id], deterministic[opt_id] = rec.global_step, rec.deterministic
            for p in rec.params:
                records[p.fqn], source_opt[p.fqn] = p, opt_id
        codebook = None
        for key in books:
            cb = schema.check_codebook(small[key], f"GefenMuon codebook {key}")
            if codebook is not None and not torch.equal(codebook, cb):
                raise GefenCheckpointError(
                    f"the checkpoint's GefenMuon codebooks disagree ({books[0]} != {key}); an agreed checkpoint "
                    "has one GefenMuon codebook for the job: it is corrupt")
            codebook = cb
        missing = [s.fqn for s in self.slots if s.fqn not in records]
        if missing:
            raise GefenCheckpointError(
                f"the checkpoint has no GefenMuon state for {len(missing)} live parameter(s) "
                f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}): it was written for "
                "another model or optimizer grouping")
        for s in self.slots:
            rec, src = records[s.fqn], source_opt[s.fqn]
            shape = tuple(s.param.shape)
            if rec.shape != shape:
                raise GefenCheckpointError(
                    f"{s.fqn}: checkpoint shape {rec.shape} != live shape {shape}: the checkpoint is for another model")
            live_det = gx.muon_deterministic(s.optim)
            if deterministic[src] != live_det:
                raise GefenCheckpointError(
                    f"the checkpoint was written with optimizer.deterministic = {deterministic[src]} and the "
                    f"recipe sets {live_det}: resume with optimizer.deterministic = {str(deterministic[src]).lower()}")
            check_muon_hyper(s.fqn, rec.group)
            why = check_muon_counters(s.fqn, rec.period, rec.step, rec.rows_step, global_steps[src])
            if why:
                raise GefenCheckpointError(why)
            if not rec.period:
                continue
            if codebook is None:
                raise GefenCheckpointError("the checkpoint holds GefenMuon state but no codebook (truncated?)")
            if shape[-1] % rec.period:
                raise GefenCheckpointError(f"{s.fqn}: period {rec.period} does not divide the last dimension")
            why = check_period_fits(s.fqn, s.param, rec.period)
            if why:
                raise GefenCheckpointError(why)
            for key, (_, want) in muon_tensor_specs(s.fqn, shape, rec.period, rec.rows_step > 0).items():
                md = ours.get(key)
                if md is None:
                    raise GefenCheckpointError(f"{s.fqn}: {key} missing from the checkpoint (truncated or foreign)")
                if tuple(md.size) != want:
                    raise GefenCheckpointError(
                        f"{s.fqn}: {key} has shape {tuple(md.size)}, expected {want} for period {rec.period}")
        return _Plan(checkpoint_id, records, codebook, global_steps, source_opt)

    def _load_destinations(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for s in self.slots:
            rec = self._plan.records[s.fqn]
            if not rec.period:
                continue
            shape, local_shape, dev = tuple(s.param.shape), tuple(s.local.shape), s.local.device
            keys = schema.muon_tensor_keys(s.fqn)
            sd[keys["codes"]] = like_param(s.param, torch.empty(local_shape, dtype=torch.uint8, device=dev), shape)
            sd[keys["magnitude"]] = like_param(
                s.param, torch.empty(grid_shape(local_shape, rec.period), dtype=torch.float32, device=dev),
                grid_shape(shape, rec.period))
            if rec.rows_step:
                sd[keys["rows"]] = like_param_rows(s.param, torch.empty(local_shape[0], dtype=torch.float32,
                                                                        device=dev))
        return sd

    def stage_load(self, sd: dict[str, Any]) -> None:
        plan = self._plan
        if plan is None and not self.slots:
            return  # no GefenMuon here: a plain load (no manager) of the other optimizers goes on
        if plan is None:
            raise GefenCheckpointError(
                "GefenMuon state can only be loaded through GefenCheckpointManager (which reads the "
                "checkpoint's records first); set the recipe's [checkpoint] as usual")
        self._plan = None
        staged, error = {}, None
        try:
            for s in self.slots:
                rec = plan.records[s.fqn]
                if not rec.period:
                    staged[s.fqn] = None
                    continue
                keys = schema.muon_tensor_keys(s.fqn)
                codes, mag = local(sd[keys["codes"]]), local(sd[keys["magnitude"]])
                rows = local(sd[keys["rows"]]) if rec.rows_step else None
                for what, t in (("magnitude", mag), ("NorMuon rows", rows)):
                    if t is not None and (not torch.isfinite(t).all() or (t < 0).any()):
                        raise GefenCheckpointError(
                            f"{s.fqn}: non-finite or negative {what} in the checkpoint (corrupt file); "
                            "resume from another step with checkpoint.load_step")
                staged[s.fqn] = gx.MuonState(
                    period=rec.period, step=rec.step, codes=codes.reshape(-1, rec.period),
                    magnitude=mag.reshape(-1, 1), rows=None if rows is None else rows.reshape(-1, 1),
                    rows_step=rec.rows_step)
        except (GefenCheckpointError, ValueError, KeyError) as e:
            error = str(e)
        refuse_on_any_rank(error, f"{_WHAT} {plan.checkpoint_id}")
        self._staged = (plan, staged)

    def _commit(self, plan: _Plan, staged: dict[str, gx.MuonState | None]) -> None:
        for s in self.slots:
            st = staged[s.fqn]
            gx.muon_write(s.optim, s.param, st)
            gx.muon_restore_group(s.group, plan.records[s.fqn].group)
        for optim in self.optimizers:
            sources = {plan.source_opt[s.fqn] for s in self.slots if s.optim is optim}
            if any(staged[s.fqn] is not None for s in self.slots if s.optim is optim):
                dev = next(s.local.device for s in self.slots if s.optim is optim)
                gx.set_codebook(optim, plan.codebook.to(dev).clone())
            else:
                gx.set_codebook(optim, None)
            gx.set_global_step(optim, max((plan.global_steps[o] for o in sources), default=0))
