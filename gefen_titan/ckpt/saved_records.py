"""Gefen's and GefenMuon's records in a checkpoint, read and checked offline (formats v3, v2 and v1).

The checks are those of a load (``gefen_titan.optim.state.sharded`` and ``.gefen_sharded``,
``.gefen_per_rank`` and, for GefenMuon's ``gefen/muon*`` entries, ``.gefen_muon_sharded``) that
do not need the live model: every record parses, counters
add up, hyperparameters are ones Gefen can represent, periods divide the last
dimension, every tensor the records imply is present with the shape and
dtype the period implies, codebooks are valid (and one for the job in v2 and v3),
v1 source shards tile each parameter; GefenMuon's records parse, their
group keys and counters are GefenMuon's, its codebooks are valid and one
for the job, and every stateful parameter has the codes, magnitudes and
(with NorMuon state) rows its record implies. Each problem names the entry
it is about, so ``verify`` can name the file. The records themselves are
parsed by ``schema`` and ``schema_muon``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.checkpoint import OPTIMIZER

from gefen_titan.checkpoint import schema, schema_v1
from gefen_titan.checkpoint.schema_muon import (
    MuonOptimizerRecord,
    MuonParamRecord,
    check_muon_counters,
    check_muon_hyper,
    muon_tensor_specs,
)
from gefen_titan.ckpt.view import Checkpoint

__all__ = ["GefenParam", "GefenOptimizer", "MuonOptimizer", "SavedRecords", "read_records", "codebook_summary"]


@dataclass
class GefenParam:
    fqn: str
    shape: tuple[int, ...]
    group: dict[str, float]
    # v2, v3: one period and counter pair; v1: per source rank (``ranks``), and
    # period/step/vmean_step summarised over them.
    period: int = 0
    step: int = 0
    vmean_step: int = 0
    ranks: dict[int, schema_v1.V1RankRow] = field(default_factory=dict)

    @property
    def grid(self) -> tuple[int, ...] | None:
        return schema.grid_shape(self.shape, self.period) if self.period else None


@dataclass
class GefenOptimizer:
    opt: str  # the first parameter's name (the records' key)
    params: list[GefenParam]
    global_step: int = 0
    deterministic: bool | None = None  # v2, v3 only
    nshards: int = 1  # v1 only: source ranks


@dataclass
class MuonOptimizer:
    """v2, v3: ``gefen/muon/{opt}``, one GefenMuon optimizer's parameters in order."""

    opt: str  # the first parameter's name (the record's key)
    params: list[MuonParamRecord]
    global_step: int
    deterministic: bool


@dataclass
class SavedRecords:
    header: schema.Header
    optimizers: list[GefenOptimizer]  # Gefen's
    codebooks: dict[str, torch.Tensor]  # entry name -> codebook (Gefen's)
    problems: list[tuple[str, str]]  # (entry name inside "optimizer.", what is wrong)
    muon_optimizers: list[MuonOptimizer] = field(default_factory=list)  # GefenMuon's (v2, v3 only)
    muon_codebooks: dict[str, torch.Tensor] = field(default_factory=dict)  # entry name -> GefenMuon codebook

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def params(self) -> list[GefenParam]:
        """Gefen's parameters (GefenMuon's are ``muon_params``)."""
        return [p for o in self.optimizers for p in o.params]

    @property
    def muon_params(self) -> list[MuonParamRecord]:
        return [p for o in self.muon_optimizers for p in o.params]


def codebook_summary(cb: torch.Tensor) -> dict[str, Any]:
    cb = cb.float()
    distinct = torch.unique(cb)
    pos = cb[cb > 0]
    neg = cb[cb < 0]
    return {
        "entries": int(cb.numel()),
        "distinct": int(distinct.numel()),
        "min": float(cb.min()),
        "max": float(cb.max()),
        "smallest_positive": float(pos.min()) if pos.numel() else None,
        "largest_negative": float(neg.max()) if neg.numel() else None,
        "sorted": bool((cb[1:] >= cb[:-1]).all()),
    }


def read_records(ck: Checkpoint) -> SavedRecords | None:
    """The checkpoint's Gefen state records (None: it holds no Gefen state).

    Raises ``CkptError`` when the header is unreadable or of an unknown
    format; everything else wrong is collected in ``problems``.
    """
    header = ck.gefen_header()
    if header is None:
        return None
    return _read_v2(ck, header) if header.version in schema.AGREED_VERSIONS else _read_v1(ck, header)


def _entries(ck: Checkpoint) -> dict[str, schema.Key]:
    """The optimizer component's Gefen entries, parsed."""
    return {name: key for name in ck.optimizer if (key := schema.parse_key(name)) is not None}


def _check_tensor(ck_opt: dict, name: str, shape: tuple, dtype: torch.dtype, why: str) -> str | None:
    e = ck_opt.get(name)
    if e is None:
        return f"{name} missing ({why}): the checkpoint is truncated or was edited"
    if not e.is_tensor or tuple(e.shape) != tuple(shape) or e.dtype != dtype:
        got = f"{e.dtype} {tuple(e.shape)}" if e.is_tensor else "a non-tensor"
        return f"{name} is {got}, expected {dtype} {tuple(shape)} ({why})"
    return None


def _hyper_problem(fqn: str, group: dict[str, Any]) -> str | None:
    try:
        schema.check_hyper(fqn, group)
    except schema.FormatError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ v2, v3
def _read_v2(ck: Checkpoint, header: schema.Header) -> SavedRecords:
    opt = ck.optimizer
    entries = _entries(ck)
    rec_names = sorted(n for n, k in entries.items() if k.kind == "optimizer")
    book_names = sorted(n for n, k in entries.items() if k.kind == "codebook")
    muon_names = sorted(n for n, k in entries.items() if k.kind in ("muon", "muon_codebook"))
    values = ck.load_names(OPTIMIZER, rec_names + book_names + muon_names)
    problems: list[tuple[str, str]] = []
    if header.blocking != "agreed":
        problems.append((schema.header_key(), f"v{header.version} header {header.to_json()} does not say blocking "
                                              "\"agreed\""))
    optimizers, seen = [], {}
    for name in rec_names:
        opt_id = entries[name].name
        try:
            rec = schema.OptimizerRecord.from_json(values[name], opt_id)
        except schema.FormatError as e:
            problems.append((name, str(e)))
            continue
        o = GefenOptimizer(opt_id, [GefenParam(p.fqn, p.shape, p.group, p.period, p.step, p.vmean_step)
                                    for p in rec.params], rec.global_step, rec.deterministic)
        optimizers.append(o)
        for p in o.params:
            if p.fqn in seen:
                problems.append((name, f"{p.fqn} has records in {seen[p.fqn]} and {opt_id}"))
            seen[p.fqn] = opt_id
            problems += [(name, w) for w in _check_v2_param(opt, p, o.global_step, header.version) if w]
    codebooks = {}
    for name in book_names:
        try:
            codebooks[name] = schema.check_codebook(values[name], f"codebook {name}")
        except schema.FormatError as e:
            problems.append((name, str(e)))
    books = list(codebooks.items())
    for name, cb in books[1:]:
        if not torch.equal(books[0][1], cb):
            problems.append((name, f"the codebooks disagree ({books[0][0]} != {name}); an agreed checkpoint has "
                                   "one codebook for the job"))
    if any(p.period for o in optimizers for p in o.params) and not codebooks and not book_names:
        problems.append((schema.header_key(), "the checkpoint holds Gefen state but no codebook (truncated?)"))
    for name, key in sorted(entries.items()):
        if key.kind in schema.PARAM_TENSORS[header.version] and key.name not in seen:
            problems.append((name, f"{name} belongs to no optimizer record"))
    state = SavedRecords(header, optimizers, codebooks, problems)
    _read_muon(opt, entries, values, seen, state)
    return state


def _check_v2_param(opt: dict, p: GefenParam, global_step: int, version: int) -> list[str | None]:
    out = [schema.check_counters(p.fqn, p.period, p.step, p.vmean_step, global_step), _hyper_problem(p.fqn, p.group)]
    if not p.period:
        return out
    if p.shape and p.shape[-1] % p.period:
        return out + [f"{p.fqn}: period {p.period} does not divide the last dimension of {p.shape}"]
    if p.period != 1 and len(p.shape) < 2:
        out.append(f"{p.fqn}: period {p.period} on a {len(p.shape)}-D parameter (agreed blocking uses 1)")
    for key, (dtype, shape) in schema.param_tensor_specs(p.fqn, p.shape, p.period, version).items():
        why = f"the shape of {p.fqn}" if dtype == torch.uint8 else f"period {p.period} of {p.fqn}"
        out.append(_check_tensor(opt, key, shape, dtype, why))
    return out


# ------------------------------------------------------------------ GefenMuon (v2, v3)
# parse_key's kinds of a GefenMuon parameter's tensors (muon_codes, ...).
_MUON_TENSOR_KINDS = frozenset(k.kind for k in map(schema.parse_key, schema.muon_tensor_keys("x").values()) if k)
_MUON_KINDS = _MUON_TENSOR_KINDS | {schema.parse_key(schema.muon_optimizer_key("x")).kind,
                                    schema.parse_key(schema.muon_codebook_key("x")).kind}


def _read_muon(opt: dict, entries: dict[str, schema.Key], values: dict, gefen_seen: dict[str, str],
               state: SavedRecords) -> None:
    """GefenMuon's records, codebooks and tensors into ``state`` (a load's checks: ``optim.state.sharded``)."""
    problems = state.problems
    seen: dict[str, str] = {}
    for name in sorted(n for n, k in entries.items() if k.kind == "muon"):
        opt_id = entries[name].name
        try:
            rec = MuonOptimizerRecord.from_json(values[name], opt_id)
        except schema.FormatError as e:
            problems.append((name, str(e)))
            continue
        state.muon_optimizers.append(MuonOptimizer(opt_id, rec.params, rec.global_step, rec.deterministic))
        for p in rec.params:
            if p.fqn in seen or p.fqn in gefen_seen:
                other = seen.get(p.fqn) or f"Gefen's {schema.optimizer_key(gefen_seen[p.fqn])}"
                problems.append((name, f"{p.fqn} has records in {other} and {opt_id}"))
            seen[p.fqn] = opt_id
            problems += [(name, w) for w in _check_muon_param(opt, p, rec.global_step) if w]
    books = sorted(n for n, k in entries.items() if k.kind == "muon_codebook")
    for name in books:
        try:
            state.muon_codebooks[name] = schema.check_codebook(values[name], f"GefenMuon codebook {name}")
        except schema.FormatError as e:
            problems.append((name, str(e)))
    valid = list(state.muon_codebooks.items())
    for name, cb in valid[1:]:
        if not torch.equal(valid[0][1], cb):
            problems.append((name, f"the GefenMuon codebooks disagree ({valid[0][0]} != {name}); an agreed "
                                   "checkpoint has one GefenMuon codebook for the job"))
    if any(p.period for p in state.muon_params) and not books:
        problems.append((schema.header_key(), "the checkpoint holds GefenMuon state but no GefenMuon codebook "
                                              "(truncated?)"))
    for name, key in sorted(entries.items()):
        if key.kind in _MUON_TENSOR_KINDS and key.name not in seen:
            problems.append((name, f"{name} belongs to no GefenMuon record"))


def _check_muon_param(opt: dict, p: MuonParamRecord, global_step: int) -> list[str | None]:
    try:
        check_muon_hyper(p.fqn, p.group)
        hyper = None
    except schema.FormatError as e:
        hyper = str(e)
    out = [check_muon_counters(p.fqn, p.period, p.step, p.rows_step, global_step), hyper]
    if not p.period or out[0]:
        return out
    if len(p.shape) < 2 or p.shape[-1] % p.period:
        return out + [f"{p.fqn}: period {p.period} does not fit the GefenMuon matrix of shape {p.shape}"]
    rows_key = schema.muon_tensor_keys(p.fqn)["rows"]
    for key, (dtype, shape) in muon_tensor_specs(p.fqn, p.shape, p.period, p.rows_step > 0).items():
        why = (f"the shape of {p.fqn}" if dtype == torch.uint8 else
               f"rows_step {p.rows_step} of {p.fqn}" if key == rows_key else f"period {p.period} of {p.fqn}")
        out.append(_check_tensor(opt, key, shape, dtype, why))
    return out


# ------------------------------------------------------------------ v1
def _read_v1(ck: Checkpoint, header: schema.Header) -> SavedRecords:
    opt = ck.optimizer
    entries = _entries(ck)
    meta_names = sorted(n for n, k in entries.items() if k.kind == "optimizer")
    small = sorted(n for n, k in entries.items() if k.kind in ("records", "rank_codebook"))
    values = ck.load_names(OPTIMIZER, meta_names + small)
    problems: list[tuple[str, str]] = []
    optimizers, codebooks = [], {}
    for name in meta_names:
        opt_id = entries[name].name
        try:
            meta = schema_v1.V1OptimizerRecord.from_json(values[name], opt_id)
        except schema.FormatError as e:
            problems.append((name, str(e)))
            continue
        o = GefenOptimizer(opt_id, [GefenParam(p.fqn, p.shape, p.group) for p in meta.params], nshards=meta.nshards)
        optimizers.append(o)
        for label in range(o.nshards):
            problems += _read_v1_rank(opt, values, o, label, codebooks)
        for p in o.params:
            why = _hyper_problem(p.fqn, p.group)
            if why:
                problems.append((name, why))
            codes = schema.codes_key(p.fqn)
            why = _check_tensor(opt, codes, p.shape, torch.uint8, f"the shape of {p.fqn}")
            if why:
                problems.append((codes, why))
            problems += [(name, w) for w in _check_v1_tiling(p)]
            steps = {r.step for r in p.ranks.values() if r.length}
            if len(steps) > 1:
                problems.append((name, f"{p.fqn}: source ranks disagree on the step count {sorted(steps)}"))
            p.step = max(steps, default=0)
            p.vmean_step = max((r.vmean_step for r in p.ranks.values()), default=0)
            periods = {r.period for r in p.ranks.values() if r.period}
            p.period = periods.pop() if len(periods) == 1 else 0
    problems += [(n, f"{n}: GefenMuon state in a format v1 checkpoint (GefenMuon writes v2 or v3)")
                 for n, k in sorted(entries.items()) if k.kind in _MUON_KINDS]
    return SavedRecords(header, optimizers, codebooks, problems)


def _read_v1_rank(opt: dict, values: dict, o: GefenOptimizer, label: int, codebooks: dict) -> list[tuple[str, str]]:
    rk = schema.records_key(o.opt, label)
    if rk not in values:
        return [(rk, f"records of source rank {label} of optimizer {o.opt} missing (truncated checkpoint?)")]
    try:
        global_step, rows = schema_v1.read_v1_rank_table(values[rk], len(o.params), rk)
    except schema.FormatError as e:
        return [(rk, str(e))]
    bk = opt.get(schema.blocks_key(o.opt, label))
    block_rows = bk.shape[0] if bk is not None and bk.is_tensor else -1
    o.global_step = max(o.global_step, global_step)
    out: list[tuple[str, str]] = []
    for p, row in zip(o.params, rows, strict=True):
        p.ranks[label] = row
        for why in (row.check(p.fqn, label, block_rows),
                    schema.check_counters(p.fqn, row.period, row.step, row.vmean_step, global_step)):
            if why:
                out.append((rk, why if why.startswith(f"{p.fqn}: source rank") else f"source rank {label}: {why}"))
    ck_name = schema.rank_codebook_key(o.opt, label)
    if any(row.period for row in rows):
        if ck_name not in values:
            out.append((ck_name, f"codebook of source rank {label} for optimizer {o.opt} missing"))
        else:
            try:
                codebooks[ck_name] = schema.check_codebook(values[ck_name], f"codebook {ck_name}")
            except schema.FormatError as e:
                out.append((ck_name, str(e)))
    return out


def _check_v1_tiling(p: GefenParam) -> list[str]:
    numel = math.prod(p.shape)
    pos = 0
    for r in sorted(p.ranks.values(), key=lambda r: r.start):
        if r.length and r.start != pos:
            return [f"{p.fqn}: source shards do not tile the parameter (gap or overlap at element {pos})"]
        pos = r.stop if r.length else pos
    if pos != numel:
        return [f"{p.fqn}: source shards cover {pos} of {numel} elements"]
    return []
