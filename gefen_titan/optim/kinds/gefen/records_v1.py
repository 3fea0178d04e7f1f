"""Format v1 (per-rank blocking): its records and rank tables.

Part of the one definition of the format (``schema``: keys, header, the v2
and v3 records; this module: what only v1 writes). A v1 checkpoint keeps
each rank's own codebook and periods; its loads re-block and requantize
where the layout changed (``gefen_titan.optim.kinds.gefen.per_rank``).

As in ``schema``, the JSON is part of the format: ``to_json`` must stay
byte-for-byte what earlier versions wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from gefen_titan.checkpoint.format.schema import FormatError
from gefen_titan.checkpoint.format.schema_records import loads_json, record_fields
from gefen_titan.optim.kinds.gefen.keys import HYPER

__all__ = ["RECORD_FIELDS", "V1ParamRecord", "V1OptimizerRecord", "V1RankRow", "v1_rank_table",
           "read_v1_rank_table"]

RECORD_FIELDS = ("start", "length", "period", "step", "vmean_step", "block0", "nblocks")  # v1 rank rows


@dataclass
class V1ParamRecord:
    """v1: a parameter's global shape and group hyperparameters."""

    fqn: str
    shape: tuple[int, ...]
    group: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "shape": list(self.shape), "group": {k: float(self.group[k]) for k in HYPER}}


@dataclass
class V1OptimizerRecord:
    """v1: ``gefen/optimizer/{opt}``, the optimizer's source ranks and parameters."""

    nshards: int
    params: list[V1ParamRecord]

    def to_json(self) -> str:
        return json.dumps({"nshards": self.nshards, "params": [p.to_dict() for p in self.params]}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: Any, opt: str) -> V1OptimizerRecord:
        what = f"optimizer record {opt}"
        data = loads_json(raw, what)
        with record_fields(what):
            return cls(int(data["nshards"]), [V1ParamRecord(str(p["fqn"]), tuple(int(s) for s in p["shape"]),
                                                            dict(p["group"])) for p in data["params"]])


@dataclass(frozen=True)
class V1RankRow:
    """v1: where a source rank's state of one parameter lies (``RECORD_FIELDS``)."""

    start: int
    length: int
    period: int
    step: int
    vmean_step: int
    block0: int
    nblocks: int

    @property
    def stop(self) -> int:
        return self.start + self.length

    def check(self, fqn: str, label: int, block_rows: int) -> str | None:
        """Why the row cannot describe ``block_rows`` saved blocks, or None."""
        p = self.period
        if (p < 0 or (p and (self.length % p or self.nblocks != self.length // p)) or (not p and self.nblocks)
                or self.block0 < 0 or self.block0 + self.nblocks > block_rows):
            return (f"{fqn}: source rank {label} has inconsistent blocks (length {self.length}, period {p}, "
                    f"blocks {self.block0}+{self.nblocks} of {block_rows})")
        return None


def v1_rank_table(global_step: int, rows: list[V1RankRow]) -> torch.Tensor:
    """``gefen/records/{opt}/{r}``: row 0 = (global step, P), then one row per parameter."""
    table = [[global_step, len(rows), 0, 0, 0, 0, 0]]
    table += [[getattr(r, f) for f in RECORD_FIELDS] for r in rows]
    return torch.tensor(table, dtype=torch.int64)


def read_v1_rank_table(table: torch.Tensor, nparams: int, what: str) -> tuple[int, list[V1RankRow]]:
    """(global step, rows) of a v1 rank table that must describe ``nparams`` parameters."""
    if tuple(table.shape) != (1 + nparams, len(RECORD_FIELDS)):
        raise FormatError(f"{what} has shape {tuple(table.shape)}, expected {(1 + nparams, len(RECORD_FIELDS))}")
    values = table.tolist()
    return int(values[0][0]), [V1RankRow(*(int(x) for x in row)) for row in values[1:]]


