"""GefenMuon's records in the Gefen checkpoint format (v2, v3), and the checks of their values.

The keys are its rows (``keys``: ``muon_optimizer_key``, ``muon_codebook_key``,
``muon_tensor_keys``).
A GefenMuon optimizer writes one record naming its kind and, per parameter
in order, its period, counters and every group key gefen-titan supports
(``MUON_HYPER``): the load checks them against the live model and restores
them, as torch optimizers restore their groups. Its tensors are the codes
(the parameter's shape), the block magnitudes (the block grid) and, once
NorMuon has stepped, NorMuon's rows (one per row of every matrix: ``[rows]``
placed like the parameter's dim 0, ``[experts, rows]`` for a grouped experts'
weight ``(E, out, in)``, placed like its first two dims), all DTensors with
the parameter's placements, so DCP reshards them as it does Gefen's.

As every kind's, the JSON is part of the format: ranks compare the bytes of
the records they write, so ``to_json`` is canonical (sorted keys, group
values normalized to JSON types).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gefen_titan.checkpoint.format.schema import FormatError, grid_shape
from gefen_titan.checkpoint.format.schema_records import KindOptimizerRecord, KindParamRecord
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.kinds.gefen_muon.keys import muon_tensor_keys

__all__ = ["KIND", "MUON_HYPER", "MuonParamRecord", "MuonOptimizerRecord", "muon_group", "muon_tensor_specs",
           "check_muon_hyper", "check_muon_counters"]

KIND = "GefenMuon"

# GefenMuon's group keys that the records carry and a load restores: those gefen-titan supports.
MUON_HYPER = gx.MUON_GROUP_KEYS
_FLOATS = ("lr", "weight_decay", "momentum", "eps", "normuon_beta2", "normuon_eps")
_ADJUST = (None, "original", "match_rms_adamw")


def _coefficients(value: Any) -> list:
    """(a, b, c), or a per-iteration list of them, as JSON lists of floats."""
    if value and isinstance(value[0], (int, float)):
        return [float(x) for x in value]
    return [[float(x) for x in entry] for entry in value]


def muon_group(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's ``MUON_HYPER`` values as the records hold them."""
    out: dict[str, Any] = {k: float(group[k]) for k in _FLOATS}
    out.update(nesterov=bool(group["nesterov"]), normuon=bool(group["normuon"]), ns_steps=int(group["ns_steps"]),
               ns_coefficients=_coefficients(group["ns_coefficients"]), adjust_lr_fn=group["adjust_lr_fn"])
    return out


@dataclass
class MuonParamRecord(KindParamRecord):
    """One GefenMuon parameter's period, counters and group keys."""

    COUNTER: ClassVar[str] = "rows_step"

    rows_step: int  # NorMuon's counter; 0: no rows saved
    group: dict[str, Any]

    def group_json(self) -> dict[str, Any]:
        return muon_group(self.group)


@dataclass
class MuonOptimizerRecord(KindOptimizerRecord[MuonParamRecord]):
    """``gefen/muon/{opt}``: one GefenMuon optimizer's parameters in order, under its kind's name."""

    PARAM: ClassVar[type[KindParamRecord]] = MuonParamRecord
    WHAT: ClassVar[str] = "GefenMuon record"

    kind: str = KIND

    def json_fields(self) -> dict[str, Any]:
        return {"kind": self.kind, **super().json_fields()}

    @classmethod
    def check_frame(cls, data: dict[str, Any], what: str) -> None:
        if data.get("kind") != KIND or data.get("blocking") != "agreed":
            raise FormatError(f"{what} is not an agreed-blocking GefenMuon record")


def muon_tensor_specs(fqn: str, shape: tuple[int, ...], period: int, rows: bool
                      ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A stateful GefenMuon parameter's entries: key -> (dtype, global shape)."""
    keys = muon_tensor_keys(fqn)
    out = {keys["codes"]: (torch.uint8, tuple(shape)), keys["magnitude"]: (torch.float32, grid_shape(shape, period))}
    if rows:
        out[keys["rows"]] = (torch.float32, tuple(shape[:-1]))  # [rows]; [experts, rows] for grouped experts
    return out


def check_muon_hyper(fqn: str, group: dict[str, Any]) -> None:
    """Group keys GefenMuon accepts (else FormatError naming the first bad one)."""
    def bad(key: str) -> FormatError:
        return FormatError(f"{fqn}: GefenMuon group key {key}={group.get(key)!r} in the checkpoint is invalid")

    for k in MUON_HYPER:
        if k not in group:
            raise FormatError(f"{fqn}: GefenMuon group key {k!r} missing from the checkpoint")
    for k in _FLOATS:
        v = group[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise bad(k)
    for k, ok in (("momentum", group["momentum"] < 1), ("normuon_beta2", group["normuon_beta2"] < 1),
                  ("eps", group["eps"] > 0), ("normuon_eps", group["normuon_eps"] > 0)):
        if not ok:
            raise bad(k)  # names the key and its value
    for k in ("nesterov", "normuon"):
        if not isinstance(group[k], bool):
            raise bad(k)
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
        raise bad("ns_steps")
    if group["adjust_lr_fn"] not in _ADJUST:
        raise bad("adjust_lr_fn")
    coeffs = group["ns_coefficients"]
    entries = [coeffs] if isinstance(coeffs, list) and coeffs and not isinstance(coeffs[0], list) else coeffs
    if (not isinstance(entries, list) or not entries or len(entries) >= 100
            or any(not isinstance(e, list) or len(e) != 3
                   or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in e)
                   for e in entries)):
        raise bad("ns_coefficients")


def check_muon_counters(fqn: str, period: int, step: int, rows_step: int, global_step: int) -> str | None:
    """Why a GefenMuon parameter's period and counters cannot be its own, or None."""
    if period < 0 or step < 0 or rows_step < 0 or rows_step > step or (period == 0) != (step == 0):
        return f"{fqn}: counters do not add up (period {period}, step {step}, rows_step {rows_step})"
    if step > global_step:
        return f"{fqn}: global step {global_step} < parameter step {step}"
    return None
