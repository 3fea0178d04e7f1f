"""Gefen's state in formats v4 (saved), v3 and v2 (loaded too): its hooks of ``ShardedAdapter``.

Gefen keeps per parameter the codes (the parameter's shape) and, per block,
a magnitude and ``vmean`` (the *block grid*: the shape with the last
dimension divided by the period). v3 and v4 store the two per-block tensors
as one entry (``gefen_keys.pack_blocks``: 8 bytes per block), v2 as two; all
load. A parameter whose second moment is factored (``factored``; v4) keeps
no ``vmean``: its grid holds the magnitude, and its row and column EMAs are
two more entries, placed like its rows and its columns.

**Switching the second moment on a resume.** Which second moment a parameter
keeps is the live run's (``[optimizer.gefen] second_moment``), whatever the
checkpoint's. Where they differ, the momentum (codes, magnitudes), the
period and ``step`` load as saved, and the second moment restarts: zero, with
its step count 0, so its bias correction treats it as new (an Adam second
moment started late; gefen-x does the same when a factored run meets a block
checkpoint). The log says so once per load.

A rank whose local shard is empty keeps no tensors, only the agreed period
and counters, so later saves still agree.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer
from torchtitan.tools.logging import logger

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import schema_records
from gefen_titan.checkpoint.format.schema import grid_shape
from gefen_titan.distributed import like_param_cols, like_param_rows
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.checkpointing.adapter import blocking_refusal
from gefen_titan.optim.checkpointing.sharded import ShardedAdapter, Slot, check_finite_nonnegative
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.optim.kinds.gefen.factored import is_factored
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
        return gefen_keys.param_tensor_specs(fqn, shape, rec.period, version, rec.factored)

    def _placed(self, s: Slot, key: str, tensor: torch.Tensor, global_shape: tuple[int, ...]):
        if key == gefen_keys.vrow_key(s.fqn):
            return like_param_rows(s.param, tensor)
        if key == gefen_keys.vcol_key(s.fqn):
            return like_param_cols(s.param, tensor)
        return super()._placed(s, key, tensor, global_shape)

    # ------------------------------------------------------------------ save
    def _save_param(self, s: Slot) -> tuple[gefen_records.ParamRecord, dict[str, torch.Tensor]]:
        period, step, vstep = self._counters(s)
        shape = tuple(s.param.shape)
        factored = is_factored(s.optim, s.param)
        rec = gefen_records.ParamRecord(s.fqn, shape, period, step, vstep, {k: float(s.group[k]) for k in HYPER},
                                        factored)
        if not period:
            return rec, {}
        local_shape = tuple(s.local.shape)
        specs = gefen_keys.param_tensor_specs(s.fqn, local_shape, period, factored=factored)
        keys = gefen_keys.param_tensor_keys(s.fqn, factored=factored)
        st = gx.gefen_read(s.optim, s.param)
        if st is None:  # an empty local shard: Gefen keeps no tensors for it (a factored one: its rows, columns)
            dev = s.local.device
            out = {key: torch.zeros(want, dtype=dtype, device=dev) for key, (dtype, want) in specs.items()}
            kept = gx.gefen_empty_shard_factors(s.optim, s.param) if factored else None
            if kept is not None:
                out[keys["vrow"]], out[keys["vcol"]] = (self._copy(t) for t in kept)
            return rec, out
        if st.factored != factored:
            raise GefenCheckpointError(
                f"{s.fqn}: its live second moment is {'factored' if st.factored else 'block'} and the run's "
                f"optimizer.gefen.second_moment says {'factored' if factored else 'block'} (state set outside "
                "gefen-titan?)")
        local_grid = grid_shape(local_shape, period) if local_shape else ()
        out = {keys["codes"]: self._copy(st.codes.view(local_shape)),
               keys["grid"]: gefen_keys.pack_blocks(st.magnitude.view(local_grid),
                                                    None if factored else st.vmean.view(local_grid))}
        if factored:
            out[keys["vrow"]] = self._copy(st.v_row)
            out[keys["vcol"]] = self._copy(st.v_col)
        return rec, out

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
        keys = gefen_keys.param_tensor_keys(s.fqn, version, rec.factored)
        by_name = {name: tensors[key] for name, key in keys.items()}
        mag, vmean = gefen_keys.unpack_blocks(version, by_name)
        check_finite_nonnegative(s.fqn, "magnitude", mag)
        check_finite_nonnegative(s.fqn, "vmean", vmean)
        for name in ("vrow", "vcol"):
            check_finite_nonnegative(s.fqn, name, by_name.get(name))
        codes = by_name["codes"].reshape(-1, rec.period)
        magnitude = mag.reshape(-1, 1).contiguous()
        local_shape = tuple(s.local.shape)
        if is_factored(s.optim, s.param):
            if rec.factored:  # as saved
                v_row, v_col, vstep = by_name["vrow"].contiguous(), by_name["vcol"].contiguous(), rec.vmean_step
            else:  # a block checkpoint: the factored moment starts here (module doc)
                rows, cols = gefen_keys.factor_shapes(local_shape)
                v_row, v_col, vstep = mag.new_zeros(rows), mag.new_zeros(cols), 0
            return gx.GefenParamState(period=rec.period, step=rec.step, vmean_step=vstep, codes=codes,
                                      magnitude=magnitude, vmean=None, v_row=v_row, v_col=v_col)
        if rec.factored:  # a factored checkpoint: the block moment starts here
            vmean, vstep = torch.zeros_like(magnitude), 0
        else:
            vmean, vstep = vmean.reshape(-1, 1).contiguous(), rec.vmean_step
        return gx.GefenParamState(period=rec.period, step=rec.step, vmean_step=vstep, codes=codes,
                                  magnitude=magnitude, vmean=vmean)

    def _commit(self, plan, staged) -> None:
        super()._commit(plan, staged)
        switched = [s.fqn for s in self.slots if plan.records[s.fqn].period
                    and plan.records[s.fqn].factored != is_factored(s.optim, s.param)]
        if switched:
            now = "block" if plan.records[switched[0]].factored else "factored"
            logger.info(f"Gefen's second moment is {now} here (optimizer.gefen.second_moment) and was not in the "
                        f"checkpoint: it restarts from zero on {len(switched)} parameter(s) ({switched[0]}, ...); "
                        "their momentum and steps load as saved")

    def _install(self, s: Slot, st: gx.GefenParamState | None, rec: gefen_records.ParamRecord) -> None:
        if st is not None and st.codes.numel() == 0:
            # An empty local shard: Gefen keeps no tensors, only the agreed
            # period and counters (so later saves agree).
            gx.gefen_write(s.optim, s.param, None)
            gx.set_period(s.optim, s.param, st.period)
            gx.gefen_set_empty_shard_counters(s.optim, s.param, st.step, st.vmean_step)
            if st.factored:
                gx.gefen_set_empty_shard_factors(s.optim, s.param, st.v_row, st.v_col)
        else:
            gx.gefen_write(s.optim, s.param, st)
        for k in HYPER:
            s.group[k] = rec.group[k]
