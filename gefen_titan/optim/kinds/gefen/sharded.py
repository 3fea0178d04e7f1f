"""Gefen's state in formats v3 (saved) and v2 (loaded too): its hooks of ``ShardedAdapter``.

Gefen keeps per parameter the codes (the parameter's shape) and, per block,
a magnitude and ``vmean`` (the *block grid*: the shape with the last
dimension divided by the period). v3 stores the two per-block tensors as
one entry (``gefen_keys.pack_blocks``: 8 bytes per block), v2 as two; both load.
A rank whose local shard is empty keeps no tensors, only the agreed period
and counters, so later saves still agree.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from gefen_titan.checkpoint.format import schema_records
from gefen_titan.checkpoint.format.schema import grid_shape
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.checkpointing.adapter import blocking_refusal
from gefen_titan.optim.checkpointing.sharded import ShardedAdapter, Slot, check_finite_nonnegative
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.optim.kinds.gefen.keys import HYPER

__all__ = ["GefenShardedAdapter"]


class GefenShardedAdapter(ShardedAdapter):
    """The ``StateAdapter`` of one rank's Gefen optimizers under agreed blocking."""

    kind = "Gefen"
    owns = staticmethod(gx.is_gefen)
    record_kind, codebook_kind, codebook_what = "gefen", "codebook", "codebook"

    def _format_refusal(self, header: schema_records.Header) -> str:
        return blocking_refusal(header, "agreed")

    def _deterministic(self, optim: Optimizer) -> bool:
        return gx.options(optim)["deterministic"]

    def _tensor_specs(self, fqn, shape, rec, version):
        return gefen_keys.param_tensor_specs(fqn, shape, rec.period, version)

    # ------------------------------------------------------------------ save
    def _save_param(self, s: Slot) -> tuple[gefen_records.ParamRecord, dict[str, torch.Tensor]]:
        period, step, vstep = self._counters(s)
        shape = tuple(s.param.shape)
        rec = gefen_records.ParamRecord(s.fqn, shape, period, step, vstep, {k: float(s.group[k]) for k in HYPER})
        if not period:
            return rec, {}
        local_shape = tuple(s.local.shape)
        local_grid = grid_shape(local_shape, period) if local_shape else ()
        st = gx.gefen_read(s.optim, s.param)
        if st is None:  # an empty local shard: Gefen keeps no tensors for it
            dev = s.local.device
            codes = torch.empty(local_shape, dtype=torch.uint8, device=dev)
            blocks = torch.empty(local_grid + (2,), dtype=torch.float32, device=dev)
        else:
            codes = self._copy(st.codes.view(local_shape))
            blocks = gefen_keys.pack_blocks(st.magnitude.view(local_grid), st.vmean.view(local_grid))
        keys = gefen_keys.param_tensor_keys(s.fqn)
        return rec, {keys["codes"]: codes, keys["grid"]: blocks}

    def _counters(self, s: Slot) -> tuple[int, int, int]:
        st = gx.gefen_read(s.optim, s.param)
        if st is not None:
            return st.period, st.step, st.vmean_step
        period = gx.period(s.optim, s.param)
        step, vstep = gx.gefen_empty_shard_counters(s.optim, s.param)
        if period and step and s.local.numel() == 0:
            return period, step, vstep
        return 0, 0, 0

    def _optimizer_record(self, optim: Optimizer,
                          params: list[gefen_records.ParamRecord]) -> gefen_records.OptimizerRecord:
        return gefen_records.OptimizerRecord(gx.options(optim)["deterministic"], gx.global_step(optim), params)

    # ------------------------------------------------------------------ load
    def _stage_param(self, s: Slot, rec: gefen_records.ParamRecord, tensors: dict[str, torch.Tensor],
                     version: int) -> gx.GefenParamState:
        keys = gefen_keys.param_tensor_keys(s.fqn, version)
        by_name = {name: tensors[key] for name, key in keys.items()}
        mag, vmean = gefen_keys.unpack_blocks(version, by_name)
        check_finite_nonnegative(s.fqn, "magnitude", mag)
        check_finite_nonnegative(s.fqn, "vmean", vmean)
        return gx.GefenParamState(period=rec.period, step=rec.step, vmean_step=rec.vmean_step,
                             codes=by_name["codes"].reshape(-1, rec.period),
                             magnitude=mag.reshape(-1, 1).contiguous(), vmean=vmean.reshape(-1, 1).contiguous())

    def _install(self, s: Slot, st: gx.GefenParamState | None, rec: gefen_records.ParamRecord) -> None:
        if st is not None and st.codes.numel() == 0:
            # An empty local shard: Gefen keeps no tensors, only the agreed
            # period and counters (so later saves agree).
            gx.gefen_write(s.optim, s.param, None)
            gx.set_period(s.optim, s.param, st.period)
            gx.gefen_set_empty_shard_counters(s.optim, s.param, st.step, st.vmean_step)
        else:
            gx.gefen_write(s.optim, s.param, st)
        for k in HYPER:
            s.group[k] = rec.group[k]
