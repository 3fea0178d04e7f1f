"""Gefen's and GefenMuon's records in a checkpoint, parsed and checked without a live model (formats v3, v2, v1).

The record stage of ``load_checks``: the load runs it on its one small read
of the records (``optim.state.load_context``) and the offline tools on
theirs (``ckpt.saved_records``), so both give the same verdict. Every
record parses, counters add up, hyperparameters are ones Gefen can
represent, periods divide the last dimension, every tensor the records
imply is present with the shape and dtype the period implies and none is
left without a record, codebooks are valid (and one for the job in v2 and
v3), v1 source shards tile each parameter; GefenMuon's records parse, their
group keys and counters are GefenMuon's, its codebooks are valid and one
for the job, and every stateful parameter has the codes, magnitudes and
(with NorMuon state) rows its record implies. What needs the live model
(the parameters' shapes, the mesh's cuts, ``deterministic``) stays with the
state adapters (``optim.state``).

Input: the optimizer component's entries (names without ``optimizer.`` ->
DCP metadata) and the values of its small entries (``schema.SMALL_KINDS``).
Each problem is ``(check, entry, what)``: ``check`` one of ``load_checks``'
names, ``entry`` the entry it is about, so ``verify`` can name the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gefen_titan.checkpoint import schema, schema_v1
from gefen_titan.checkpoint.schema_muon import (
    MuonOptimizerRecord,
    MuonParamRecord,
    check_muon_counters,
    check_muon_hyper,
    muon_tensor_specs,
)

__all__ = ["RECORDS", "RECORD_TENSORS", "CODEBOOKS", "GefenParam", "GefenOptimizer", "MuonOptimizer",
           "SavedRecords", "read_saved", "small_names"]

# The checks of this stage, by their name in load_checks.CHECKS.
RECORDS = "records"  # the header and every record parse; counters, hyperparameters, one record per parameter
RECORD_TENSORS = "record tensors"  # the tensors a record implies, present with their shape and dtype; no stray one
CODEBOOKS = "codebooks"  # valid, one for the job (v2, v3), present wherever there is state

Problem = tuple[str, str, str]  # (check, entry, what)


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
    checked: list[Problem]  # every problem found, (check, entry name inside "optimizer.", what)
    muon_optimizers: list[MuonOptimizer] = field(default_factory=list)  # GefenMuon's (v2, v3 only)
    muon_codebooks: dict[str, torch.Tensor] = field(default_factory=dict)  # entry name -> GefenMuon codebook

    @property
    def problems(self) -> list[tuple[str, str]]:
        """(entry, what) of every problem."""
        return [(entry, what) for _, entry, what in self.checked]

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


def small_names(entries: dict[str, Any]) -> list[str]:
    """The entries the checks read (``schema.SMALL_KINDS``: header, records, codebooks, v1's rank tables)."""
    return sorted(n for n in entries if (k := schema.parse_key(n)) is not None and k.kind in schema.SMALL_KINDS)


def read_saved(entries: dict[str, Any], values: dict[str, Any]) -> SavedRecords | None:
    """The records, parsed, and every problem found (None: the checkpoint holds no Gefen state).

    Raises ``schema.FormatError`` when the header is unreadable or of an unknown format.
    """
    if schema.header_key() not in values:
        return None
    header = schema.Header.from_json(values[schema.header_key()])
    parsed = {name: key for name in entries if (key := schema.parse_key(name)) is not None}
    reader = _read_v2 if header.version in schema.AGREED_VERSIONS else _read_v1
    state = reader(entries, parsed, values, header)
    # An entry in Gefen's namespace of no kind this version knows: state of a kind added later (or an
    # edit). Loading on without it would drop that state without a word.
    for name in sorted(n for n in entries if schema.is_gefen_key(n) and n not in parsed):
        kind = name[len(schema.PREFIX):].partition("/")[0]
        state.checked.append((RECORD_TENSORS, name, (
            f"{name}: an entry of kind {kind!r}, which this gefen-titan does not know (written by a newer one, "
            "or edited): load the checkpoint with the gefen-titan that wrote it")))
    return state


def _check_tensor(entries: dict[str, Any], name: str, shape: tuple, dtype: torch.dtype, why: str) -> str | None:
    md = entries.get(name)
    if md is None:
        return f"{name} missing ({why}): the checkpoint is truncated or was edited"
    if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(shape) or md.properties.dtype != dtype:
        got = f"{md.properties.dtype} {tuple(md.size)}" if isinstance(md, TensorStorageMetadata) else "a non-tensor"
        return f"{name} is {got}, expected {dtype} {tuple(shape)} ({why})"
    return None


def _hyper_problem(fqn: str, group: dict[str, Any]) -> str | None:
    try:
        schema.check_hyper(fqn, group)
    except schema.FormatError as e:
        return str(e)
    return None


def _codebooks(names: list[str], values: dict[str, Any], what: str, out: dict[str, torch.Tensor],
               problems: list[Problem]) -> None:
    """Each codebook valid, and all of them one (an agreed checkpoint has one codebook for the job)."""
    for name in names:
        try:
            out[name] = schema.check_codebook(values[name], f"{what} {name}")
        except schema.FormatError as e:
            problems.append((CODEBOOKS, name, str(e)))
    valid = list(out.items())
    for name, cb in valid[1:]:
        if not torch.equal(valid[0][1], cb):
            problems.append((CODEBOOKS, name, f"the {what}s disagree ({valid[0][0]} != {name}); an agreed "
                                              f"checkpoint has one {what} for the job"))


# ------------------------------------------------------------------ v2, v3
_OWN_RECORD_KINDS = frozenset({"header", "optimizer", "muon"})  # the records this stage parses itself


def _read_v2(entries: dict[str, Any], parsed: dict[str, schema.Key], values: dict[str, Any],
             header: schema.Header) -> SavedRecords:
    rec_names = sorted(n for n, k in parsed.items() if k.kind == "optimizer")
    book_names = sorted(n for n, k in parsed.items() if k.kind == "codebook")
    problems: list[Problem] = []
    if header.blocking != "agreed":
        problems.append((RECORDS, schema.header_key(), f"v{header.version} header {header.to_json()} does not say "
                                                       "blocking \"agreed\""))
    optimizers, seen = [], {}
    for name in rec_names:
        opt_id = parsed[name].name
        try:
            rec = schema.OptimizerRecord.from_json(values[name], opt_id)
        except schema.FormatError as e:
            problems.append((RECORDS, name, str(e)))
            continue
        o = GefenOptimizer(opt_id, [GefenParam(p.fqn, p.shape, p.group, p.period, p.step, p.vmean_step)
                                    for p in rec.params], rec.global_step, rec.deterministic)
        optimizers.append(o)
        for p in o.params:
            if p.fqn in seen:
                problems.append((RECORDS, name, f"{p.fqn} has records in {seen[p.fqn]} and {opt_id}"))
            seen[p.fqn] = opt_id
            problems += [(c, name, w) for c, w in _check_v2_param(entries, p, o.global_step, header.version) if w]
    codebooks: dict[str, torch.Tensor] = {}
    _codebooks(book_names, values, "codebook", codebooks, problems)
    if any(p.period for o in optimizers for p in o.params) and not book_names:
        problems.append((CODEBOOKS, schema.header_key(), "the checkpoint holds Gefen state but no codebook "
                                                         "(truncated?)"))
    owned = set(seen) | _other_kinds_params(parsed, values)
    for name, key in sorted(parsed.items()):
        if key.kind in schema.PARAM_TENSORS[header.version] and key.name not in owned:
            problems.append((RECORD_TENSORS, name, f"{name} belongs to no optimizer record"))
    state = SavedRecords(header, optimizers, codebooks, problems)
    _read_muon(entries, parsed, values, seen, state)
    return state


def _other_kinds_params(parsed: dict[str, schema.Key], values: dict[str, Any]) -> set[str]:
    """Parameters that records of a registered kind (``schema.register_kinds``) own: a kind may keep
    Gefen's tensor kinds under its own records, and its state type checks them (not this stage)."""
    out: set[str] = set()
    for name, key in parsed.items():
        if key.kind not in _OWN_RECORD_KINDS and schema.SMALL_KINDS.get(key.kind) == "str" and name in values:
            try:
                out.update(schema.record_fqns(values[name], name))
            except schema.FormatError:
                pass  # its own state type refuses it
    return out


def _check_v2_param(entries: dict[str, Any], p: GefenParam, global_step: int,
                    version: int) -> list[tuple[str, str | None]]:
    out = [(RECORDS, schema.check_counters(p.fqn, p.period, p.step, p.vmean_step, global_step)),
           (RECORDS, _hyper_problem(p.fqn, p.group))]
    if not p.period:
        return out
    if p.shape and p.shape[-1] % p.period:
        return out + [(RECORDS, f"{p.fqn}: period {p.period} does not divide the last dimension of {p.shape}")]
    if p.period != 1 and len(p.shape) < 2:
        out.append((RECORDS, f"{p.fqn}: period {p.period} on a {len(p.shape)}-D parameter (agreed blocking uses 1)"))
    for key, (dtype, shape) in schema.param_tensor_specs(p.fqn, p.shape, p.period, version).items():
        why = f"the shape of {p.fqn}" if dtype == torch.uint8 else f"period {p.period} of {p.fqn}"
        out.append((RECORD_TENSORS, _check_tensor(entries, key, shape, dtype, why)))
    return out


# ------------------------------------------------------------------ GefenMuon (v2, v3)
# parse_key's kinds of a GefenMuon parameter's tensors (muon_codes, ...).
_MUON_TENSOR_KINDS = frozenset(k.kind for k in map(schema.parse_key, schema.muon_tensor_keys("x").values()) if k)
_MUON_KINDS = _MUON_TENSOR_KINDS | {schema.parse_key(schema.muon_optimizer_key("x")).kind,
                                    schema.parse_key(schema.muon_codebook_key("x")).kind}


def _read_muon(entries: dict[str, Any], parsed: dict[str, schema.Key], values: dict[str, Any],
               gefen_seen: dict[str, str], state: SavedRecords) -> None:
    """GefenMuon's records, codebooks and tensors into ``state``."""
    problems = state.checked
    seen: dict[str, str] = {}
    for name in sorted(n for n, k in parsed.items() if k.kind == "muon"):
        opt_id = parsed[name].name
        try:
            rec = MuonOptimizerRecord.from_json(values[name], opt_id)
        except schema.FormatError as e:
            problems.append((RECORDS, name, str(e)))
            continue
        state.muon_optimizers.append(MuonOptimizer(opt_id, rec.params, rec.global_step, rec.deterministic))
        for p in rec.params:
            if p.fqn in seen or p.fqn in gefen_seen:
                other = seen.get(p.fqn) or f"Gefen's {schema.optimizer_key(gefen_seen[p.fqn])}"
                problems.append((RECORDS, name, f"{p.fqn} has records in {other} and {opt_id}"))
            seen[p.fqn] = opt_id
            problems += [(c, name, w) for c, w in _check_muon_param(entries, p, rec.global_step) if w]
    books = sorted(n for n, k in parsed.items() if k.kind == "muon_codebook")
    _codebooks(books, values, "GefenMuon codebook", state.muon_codebooks, problems)
    if any(p.period for p in state.muon_params) and not books:
        problems.append((CODEBOOKS, schema.header_key(), "the checkpoint holds GefenMuon state but no GefenMuon "
                                                         "codebook (truncated?)"))
    for name, key in sorted(parsed.items()):
        if key.kind in _MUON_TENSOR_KINDS and key.name not in seen:
            problems.append((RECORD_TENSORS, name, f"{name} belongs to no GefenMuon record"))


def _check_muon_param(entries: dict[str, Any], p: MuonParamRecord, global_step: int) -> list[tuple[str, str | None]]:
    try:
        check_muon_hyper(p.fqn, p.group)
        hyper = None
    except schema.FormatError as e:
        hyper = str(e)
    counters = check_muon_counters(p.fqn, p.period, p.step, p.rows_step, global_step)
    out = [(RECORDS, counters), (RECORDS, hyper)]
    if not p.period or counters:
        return out
    if len(p.shape) < 2 or p.shape[-1] % p.period:
        return out + [(RECORDS, f"{p.fqn}: period {p.period} does not fit the GefenMuon matrix of shape {p.shape}")]
    rows_key = schema.muon_tensor_keys(p.fqn)["rows"]
    for key, (dtype, shape) in muon_tensor_specs(p.fqn, p.shape, p.period, p.rows_step > 0).items():
        why = (f"the shape of {p.fqn}" if dtype == torch.uint8 else
               f"rows_step {p.rows_step} of {p.fqn}" if key == rows_key else f"period {p.period} of {p.fqn}")
        out.append((RECORD_TENSORS, _check_tensor(entries, key, shape, dtype, why)))
    return out


# ------------------------------------------------------------------ v1
def _read_v1(entries: dict[str, Any], parsed: dict[str, schema.Key], values: dict[str, Any],
             header: schema.Header) -> SavedRecords:
    meta_names = sorted(n for n, k in parsed.items() if k.kind == "optimizer")
    problems: list[Problem] = []
    optimizers: list[GefenOptimizer] = []
    codebooks: dict[str, torch.Tensor] = {}
    for name in meta_names:
        opt_id = parsed[name].name
        try:
            meta = schema_v1.V1OptimizerRecord.from_json(values[name], opt_id)
        except schema.FormatError as e:
            problems.append((RECORDS, name, str(e)))
            continue
        o = GefenOptimizer(opt_id, [GefenParam(p.fqn, p.shape, p.group) for p in meta.params], nshards=meta.nshards)
        optimizers.append(o)
        for label in range(o.nshards):
            problems += _read_v1_rank(entries, values, o, label, codebooks)
        for p in o.params:
            why = _hyper_problem(p.fqn, p.group)
            if why:
                problems.append((RECORDS, name, why))
            codes = schema.codes_key(p.fqn)
            why = _check_tensor(entries, codes, p.shape, torch.uint8, f"the shape of {p.fqn}")
            if why:
                problems.append((RECORD_TENSORS, codes, why))
            problems += [(RECORDS, name, w) for w in _check_v1_tiling(p)]
            steps = {r.step for r in p.ranks.values() if r.length}
            if len(steps) > 1:
                problems.append((RECORDS, name, f"{p.fqn}: source ranks disagree on the step count {sorted(steps)}"))
            p.step = max(steps, default=0)
            p.vmean_step = max((r.vmean_step for r in p.ranks.values()), default=0)
            periods = {r.period for r in p.ranks.values() if r.period}
            p.period = periods.pop() if len(periods) == 1 else 0
    problems += [(RECORDS, n, f"{n}: GefenMuon state in a format v1 checkpoint (GefenMuon writes v2 or v3)")
                 for n, k in sorted(parsed.items()) if k.kind in _MUON_KINDS]
    return SavedRecords(header, optimizers, codebooks, problems)


def _read_v1_rank(entries: dict[str, Any], values: dict[str, Any], o: GefenOptimizer, label: int,
                  codebooks: dict[str, torch.Tensor]) -> list[Problem]:
    rk = schema.records_key(o.opt, label)
    if rk not in values:
        return [(RECORDS, rk, f"records of source rank {label} of optimizer {o.opt} missing (truncated checkpoint?)")]
    try:
        global_step, rows = schema_v1.read_v1_rank_table(values[rk], len(o.params), rk)
    except schema.FormatError as e:
        return [(RECORDS, rk, str(e))]
    bk = entries.get(schema.blocks_key(o.opt, label))
    block_rows = bk.size[0] if isinstance(bk, TensorStorageMetadata) and len(bk.size) else -1
    o.global_step = max(o.global_step, global_step)
    out: list[Problem] = []
    for p, row in zip(o.params, rows, strict=True):
        p.ranks[label] = row
        for why in (row.check(p.fqn, label, block_rows),
                    schema.check_counters(p.fqn, row.period, row.step, row.vmean_step, global_step)):
            if why:
                out.append((RECORDS, rk, why if why.startswith(f"{p.fqn}: source rank")
                            else f"source rank {label}: {why}"))
    ck_name = schema.rank_codebook_key(o.opt, label)
    if any(row.period for row in rows):
        if ck_name not in values:
            out.append((CODEBOOKS, ck_name, f"codebook of source rank {label} for optimizer {o.opt} missing"))
        else:
            try:
                codebooks[ck_name] = schema.check_codebook(values[ck_name], f"codebook {ck_name}")
            except schema.FormatError as e:
                out.append((CODEBOOKS, ck_name, str(e)))
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
