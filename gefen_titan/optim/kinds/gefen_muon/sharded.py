"""GefenMuon's state in formats v2 and v3 (the same keys): its hooks of ``ShardedAdapter``.

The sharded step (``gefen_titan.optim.muon``) keeps each rank's momentum on
its shard of the parameter: the codes are the shard's elements, the
magnitudes its block grid, NorMuon's rows its rows (``[rows]``, placed like
the parameter's dim 0; a grouped experts' weight ``(E, out, in)`` keeps
``[E, out]``, placed like its first two dims). The records carry every group key gefen-titan
supports (``muon_records.MUON_HYPER``), restored on load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from gefen_titan.checkpoint.format.schema import grid_shape
from gefen_titan.distributed import like_param_rows
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.checkpointing.sharded import ShardedAdapter, Slot, check_finite_nonnegative
from gefen_titan.optim.kinds.gefen_muon import keys as muon_keys
from gefen_titan.optim.kinds.gefen_muon.records import (
    MuonOptimizerRecord,
    MuonParamRecord,
    muon_tensor_specs,
)

__all__ = ["GefenMuonShardedAdapter"]


class GefenMuonShardedAdapter(ShardedAdapter):
    """The ``StateAdapter`` of one rank's GefenMuon optimizers."""

    kind = "GefenMuon"
    owns = staticmethod(gx.is_gefen_muon)
    record_kind, codebook_kind, codebook_what = "muon", "muon_codebook", "GefenMuon codebook"

    def _deterministic(self, optim: Optimizer) -> bool:
        return gx.muon_deterministic(optim)

    def _tensor_specs(self, fqn, shape, rec, version):
        return muon_tensor_specs(fqn, shape, rec.period, rec.rows_step > 0)

    def _placed(self, s: Slot, key: str, tensor: torch.Tensor, global_shape: tuple[int, ...]) -> Any:
        if key == muon_keys.muon_tensor_keys(s.fqn)["rows"]:
            return like_param_rows(s.param, tensor)
        return super()._placed(s, key, tensor, global_shape)

    # ------------------------------------------------------------------ save
    def _save_param(self, s: Slot) -> tuple[MuonParamRecord, dict[str, torch.Tensor]]:
        st = gx.muon_read(s.optim, s.param)
        shape = tuple(s.param.shape)
        if st is None:
            return MuonParamRecord(s.fqn, shape, 0, 0, 0, s.group), {}
        local_shape = tuple(s.local.shape)
        keys = muon_keys.muon_tensor_keys(s.fqn)
        entries = {keys["codes"]: self._copy(st.codes.view(local_shape)),
                   keys["magnitude"]: self._copy(st.magnitude.view(grid_shape(local_shape, st.period)))}
        if st.rows is not None:
            entries[keys["rows"]] = self._copy(st.rows.view(local_shape[:-1]))
        return MuonParamRecord(s.fqn, shape, st.period, st.step, st.rows_step, s.group), entries

    def _optimizer_record(self, optim: Optimizer, params: list[MuonParamRecord]) -> MuonOptimizerRecord:
        return MuonOptimizerRecord(gx.muon_deterministic(optim), gx.global_step(optim), params)

    # ------------------------------------------------------------------ load
    def _stage_param(self, s: Slot, rec: MuonParamRecord, tensors: dict[str, torch.Tensor],
                     version: int) -> gx.MuonState:
        keys = muon_keys.muon_tensor_keys(s.fqn)
        codes, mag = tensors[keys["codes"]], tensors[keys["magnitude"]]
        rows = tensors[keys["rows"]] if rec.rows_step else None
        check_finite_nonnegative(s.fqn, "magnitude", mag)
        check_finite_nonnegative(s.fqn, "NorMuon rows", rows)
        return gx.MuonState(period=rec.period, step=rec.step, codes=codes.reshape(-1, rec.period),
                            magnitude=mag.reshape(-1, 1), rows=None if rows is None else rows.reshape(-1, 1),
                            rows_step=rec.rows_step)

    def _install(self, s: Slot, st: gx.MuonState | None, rec: MuonParamRecord) -> None:
        gx.muon_write(s.optim, s.param, st)
        gx.muon_restore_group(s.group, rec.group)
