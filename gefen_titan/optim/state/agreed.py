"""Formats v3 and v2: Gefen state under agreed blocking, resharded by DCP alone.

With agreed blocking (``gefen_titan.optim.blocking``) every rank holds the same
codebook and the same period per parameter, and no block crosses a shard
cut of any allowed layout. Each rank's state is then a slice of one global
state: the codes are the parameter's shape, the per-block magnitude and
``vmean`` a *block grid* (the shape with the last dimension divided by the
period) that shards with the parameter's own placements. Saving (v3) hands
DCP views of Gefen's codes and one packed copy of the two per-block tensors
(``schema.pack_blocks``: 8 bytes per block) as DTensors with those
placements; loading asks DCP for the live placements and installs what it
read as Gefen's state, so a resume at any FSDP / TP / HSDP / pipeline layout
is bit-exact and costs no more than reading the bytes. v2 checkpoints (the
per-block tensors as two entries) load the same way.

Before DCP reads, ``prepare_load`` reads the small records (periods,
counters, hyperparameters, the codebook), checks them against the live
model and layout on every rank alike, and fixes the grid shapes of the
destinations. ``stage_load`` checks the values read and agrees on every
rank; ``commit_load`` installs them (``staging``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gefen_titan.checkpoint import schema
from gefen_titan.checkpoint.errors import GefenCheckpointError, refuse_on_any_rank
from gefen_titan.checkpoint.schema import HYPER, grid_shape
from gefen_titan.distributed import like_param, local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.blocking import check_period_fits
from gefen_titan.optim.state.staging import AgreedAdapter, Slot

__all__ = ["AgreedStateAdapter"]


@dataclass
class _Plan:
    checkpoint_id: str
    records: dict[str, schema.ParamRecord]  # fqn -> saved record (period, counters, group)
    codebook: torch.Tensor | None
    global_steps: dict[str, int]  # saved opt id -> global step
    source_opt: dict[str, str]  # fqn -> saved opt id
    version: int  # schema.AGREED_VERSIONS


class AgreedStateAdapter(AgreedAdapter):
    """Format v3 (saves; v2 and v3 loads) state of the Gefen optimizers of one rank."""

    kind = "Gefen"
    owns = staticmethod(gx.is_gefen)
    record_kind, codebook_kind = "optimizer", "codebook"

    @property
    def loading(self) -> bool:
        return self._plan is not None

    # ------------------------------------------------------------------ save
    def _save_entries(self) -> dict[str, Any]:
        if not self.slots:
            return {}
        sd: dict[str, Any] = {schema.header_key(): schema.Header.for_blocking("agreed").to_json()}
        books = {id(o): gx.codebook(o) for o in self.optimizers}
        present = [b for b in books.values() if b is not None]
        if any(not torch.equal(present[0].cpu(), b.cpu()) for b in present[1:]):
            raise GefenCheckpointError(
                "the Gefen optimizers of this rank hold different codebooks; agreed blocking gives "
                "the whole job one codebook (was state loaded or edited outside gefen_titan?)")
        copy = (lambda t: t.clone()) if self.snapshot_on_save else (lambda t: t)
        for optim in self.optimizers:
            slots = [s for s in self.slots if s.optim is optim]
            params = []
            for s in slots:
                period, step, vstep = self._counters(s)
                params.append(schema.ParamRecord(s.fqn, tuple(s.param.shape), period, step, vstep,
                                                 {k: float(s.group[k]) for k in HYPER}))
                if not period:
                    continue
                shape = tuple(s.param.shape)
                grid = grid_shape(shape, period)
                local_shape = tuple(s.local.shape)
                local_grid = grid_shape(local_shape, period) if local_shape else ()
                st = gx.read(optim, s.param)
                if st is None:  # an empty local shard: Gefen keeps no tensors for it
                    dev = s.local.device
                    codes = torch.empty(local_shape, dtype=torch.uint8, device=dev)
                    blocks = torch.empty(local_grid + (2,), dtype=torch.float32, device=dev)
                else:
                    codes = copy(st.codes.view(local_shape))
                    blocks = schema.pack_blocks(st.magnitude.view(local_grid), st.vmean.view(local_grid))
                keys = schema.param_tensor_keys(s.fqn)
                sd[keys["codes"]] = like_param(s.param, codes, shape)
                sd[keys["grid"]] = like_param(s.param, blocks, grid + (2,))
            opt_id = slots[0].opt_id
            record = schema.OptimizerRecord(gx.options(optim)["deterministic"], gx.global_step(optim), params)
            sd[schema.optimizer_key(opt_id)] = record.to_json()
            cb = books[id(optim)]
            if cb is not None:
                sd[schema.codebook_key(opt_id)] = cb.detach().float().cpu().clone()
        return sd

    def _counters(self, s: Slot) -> tuple[int, int, int]:
        st = gx.read(s.optim, s.param)
        if st is not None:
            return st.period, st.step, st.vmean_step
        period = gx.period(s.optim, s.param)
        step, vstep = gx.empty_shard_counters(s.optim, s.param)
        if period and step and s.local.numel() == 0:
            return period, step, vstep
        return 0, 0, 0

    # ------------------------------------------------------------------ load
    def _plan_from(self, checkpoint_id, small, ours, opt_keys, books, version) -> _Plan:
        records, source_opt, global_steps = {}, {}, {}
        deterministic = {}
        for key in opt_keys:
            opt_id = schema.parse_key(key).name
            rec = schema.OptimizerRecord.from_json(small[key], opt_id)
            global_steps[opt_id] = rec.global_step
            deterministic[opt_id] = rec.deterministic
            for p in rec.params:
                records[p.fqn] = p
                source_opt[p.fqn] = opt_id
        codebook = None
        for key in books:
            cb = schema.check_codebook(small[key], f"codebook {key}")
            if codebook is not None and not torch.equal(codebook, cb):
                raise GefenCheckpointError(
                    f"the checkpoint's codebooks disagree ({books[0]} != {key}); an agreed checkpoint "
                    "has one codebook for the job: it is corrupt")
            codebook = cb
        missing = [s.fqn for s in self.slots if s.fqn not in records]
        if missing:
            raise GefenCheckpointError(
                f"the checkpoint has no Gefen state for {len(missing)} live parameter(s) "
                f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}): it was written for "
                "another model or optimizer grouping")
        for s in self.slots:
            rec = records[s.fqn]
            src = source_opt[s.fqn]
            if rec.shape != tuple(s.param.shape):
                raise GefenCheckpointError(
                    f"{s.fqn}: checkpoint shape {rec.shape} != live shape {tuple(s.param.shape)}: "
                    "the checkpoint is for another model")
            live_det = gx.options(s.optim)["deterministic"]
            if deterministic[src] != live_det:
                raise GefenCheckpointError(
                    f"the checkpoint was written with optimizer.deterministic = {deterministic[src]} and "
                    f"the recipe sets {live_det}; they change Gefen's arithmetic: resume with "
                    f"optimizer.deterministic = {str(deterministic[src]).lower()}")
            schema.check_hyper(s.fqn, rec.group)
            period = rec.period
            why = schema.check_counters(s.fqn, period, rec.step, rec.vmean_step, global_steps[src])
            if why:
                raise GefenCheckpointError(why)
            if not period:
                continue
            if codebook is None:
                raise GefenCheckpointError("the checkpoint holds Gefen state but no codebook (truncated?)")
            if tuple(s.param.shape) and s.param.shape[-1] % period:
                raise GefenCheckpointError(f"{s.fqn}: period {period} does not divide the last dimension")
            why = check_period_fits(s.fqn, s.param, period)
            if why:
                raise GefenCheckpointError(why)
            for key, (_, want) in schema.param_tensor_specs(s.fqn, tuple(s.param.shape), period, version).items():
                md = ours.get(key)
                if md is None:
                    raise GefenCheckpointError(f"{s.fqn}: {key} missing from the checkpoint (truncated or foreign)")
                if tuple(md.size) != want:
                    raise GefenCheckpointError(
                        f"{s.fqn}: {key} has shape {tuple(md.size)}, expected {want} for period {period}")
        return _Plan(checkpoint_id, records, codebook, global_steps, source_opt, version)

    def _load_destinations(self) -> dict[str, Any]:
        plan = self._plan
        sd: dict[str, Any] = {}
        for s in self.slots:
            period = plan.records[s.fqn].period
            if not period:
                continue
            # The same entries at the local shard's shape (periods fit every cut: checked in _plan_from).
            here = schema.param_tensor_specs(s.fqn, tuple(s.local.shape), period, plan.version)
            for key, (dtype, want) in schema.param_tensor_specs(s.fqn, tuple(s.param.shape), period,
                                                                plan.version).items():
                sd[key] = like_param(s.param, torch.empty(here[key][1], dtype=dtype, device=s.local.device), want)
        return sd

    def stage_load(self, sd: dict[str, Any]) -> None:
        plan = self._plan
        if plan is None:
            raise GefenCheckpointError(
                "Gefen state can only be loaded through GefenCheckpointManager (which reads the "
                "checkpoint's records first); set the recipe's [checkpoint] as usual")
        self._plan = None
        staged, error = {}, None
        try:
            for s in self.slots:
                rec = plan.records[s.fqn]
                period = rec.period
                if not period:
                    staged[s.fqn] = None
                    continue
                keys = schema.param_tensor_keys(s.fqn, plan.version)
                tensors = {name: local(sd[key]) for name, key in keys.items()}
                codes = tensors["codes"]
                mag, vmean = schema.unpack_blocks(plan.version, tensors)
                for what, t in (("magnitude", mag), ("vmean", vmean)):
                    if not torch.isfinite(t).all() or (t < 0).any():
                        raise GefenCheckpointError(
                            f"{s.fqn}: non-finite or negative {what} in the checkpoint (corrupt file); "
                            "resume from another step with checkpoint.load_step")
                staged[s.fqn] = gx.ParamState(
                    period=period, step=rec.step, vmean_step=rec.vmean_step,
                    codes=codes.reshape(-1, period), magnitude=mag.reshape(-1, 1).contiguous(),
                    vmean=vmean.reshape(-1, 1).contiguous())
        except (GefenCheckpointError, ValueError, KeyError) as e:
            error = str(e)
        refuse_on_any_rank(error, f"cannot load Gefen optimizer state from {plan.checkpoint_id}")
        self._staged = (plan, staged)

    def _commit(self, plan: _Plan, staged: dict[str, gx.ParamState | None]) -> None:
        for s in self.slots:
            st = staged[s.fqn]
            rec = plan.records[s.fqn]
            if st is not None and st.codes.numel() == 0:
                # An empty local shard: Gefen keeps no tensors, only the
                # agreed period and counters (so later saves agree).
                gx.write(s.optim, s.param, None)
                gx.set_period(s.optim, s.param, st.period)
                gx.set_empty_shard_counters(s.optim, s.param, st.step, st.vmean_step)
            else:
                gx.write(s.optim, s.param, st)
            for k in HYPER:
                s.group[k] = rec.group[k]
        for optim in self.optimizers:
            sources = {plan.source_opt[s.fqn] for s in self.slots if s.optim is optim}
            has_state = any(staged[s.fqn] is not None for s in self.slots if s.optim is optim)
            if has_state:
                dev = next(s.local.device for s in self.slots if s.optim is optim)
                gx.set_codebook(optim, plan.codebook.to(dev).clone())
            else:
                gx.set_codebook(optim, None)
            gx.set_global_step(optim, max((plan.global_steps[o] for o in sources), default=0))
