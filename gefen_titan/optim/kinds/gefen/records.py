"""Gefen's v2/v3 records in the checkpoint format (``gefen/optimizer/{opt}``), and the checks of their
values: hyperparameters Gefen can represent, counters that add up.

The JSON is part of the format: ranks compare the bytes of the records they
write (DCP keeps one copy), so ``to_json`` (the frame's, ``schema_records``)
must stay byte-for-byte what earlier versions wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gefen_titan.checkpoint.format.schema import FormatError
from gefen_titan.checkpoint.format.schema_records import KindOptimizerRecord, KindParamRecord
from gefen_titan.optim.kinds.gefen.keys import HYPER

__all__ = ["ParamRecord", "OptimizerRecord", "check_hyper", "check_counters"]


SECOND_MOMENT = "second_moment"  # v4: the key of a factored parameter's record ("factored"; absent: block)


@dataclass
class ParamRecord(KindParamRecord):
    """v2, v3, v4: one parameter's period, counters and group hyperparameters; v4: whether its second
    moment is factored (``vmean_step`` then counts the factored EMAs' steps)."""

    COUNTER: ClassVar[str] = "vmean_step"

    vmean_step: int
    group: dict[str, float]
    factored: bool = False

    def group_json(self) -> dict[str, float]:
        return {k: float(self.group[k]) for k in HYPER}

    def to_dict(self) -> dict[str, Any]:
        # A block parameter's JSON stays v3's, byte for byte: the key is written only when factored.
        out = KindParamRecord.to_dict(self)
        if self.factored:
            out[SECOND_MOMENT] = "factored"
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ParamRecord:
        rec = super().from_dict(raw)
        mode = raw.get(SECOND_MOMENT)
        if mode not in (None, "factored"):
            raise FormatError(f"{rec.fqn}: {SECOND_MOMENT} {mode!r} (a record holds \"factored\" or nothing)")
        if mode and len(rec.shape) < 2:
            raise FormatError(f"{rec.fqn}: a factored second moment on a {len(rec.shape)}-D parameter")
        rec.factored = bool(mode)
        return rec


@dataclass
class OptimizerRecord(KindOptimizerRecord[ParamRecord]):
    """v2, v3: ``gefen/optimizer/{opt}``, one Gefen optimizer's parameters in order."""

    PARAM: ClassVar[type[KindParamRecord]] = ParamRecord
    WHAT: ClassVar[str] = "optimizer record"


def check_hyper(fqn: str, group: dict[str, Any]) -> None:
    """Group hyperparameters that Gefen can represent (else FormatError)."""
    for k in HYPER:
        v = group.get(k)
        if not isinstance(v, (int, float)) or not (v == v) or v < 0:
            raise FormatError(f"{fqn}: hyperparameter {k}={v!r} in the checkpoint is invalid")
    if not (group["beta1"] < 1 and group["beta2"] < 1 and group["eps"] > 0):
        raise FormatError(f"{fqn}: checkpoint hyperparameters {group} cannot be represented by Gefen")


def check_counters(fqn: str, period: int, step: int, vmean_step: int, global_step: int | None = None) -> str | None:
    """Why a parameter's period and counters cannot be Gefen's, or None."""
    if period < 0 or step < 0 or vmean_step < 0 or vmean_step > step or (period == 0) != (step == 0):
        return f"{fqn}: counters do not add up (period {period}, step {step}, vmean_step {vmean_step})"
    if global_step is not None and step > global_step:
        return f"{fqn}: global step {global_step} < parameter step {step}"
    return None
