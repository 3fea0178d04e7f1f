"""Gefen's state in a checkpoint, described for the records stage and the offline tools (formats v3, v2, v1).

``description`` builds Gefen's ``kinds.KindDescription`` (the registry
entry's ``checkpoint``): its records parsed and checked without a live model
(every record parses, counters add up, hyperparameters are ones Gefen can
represent, periods divide the last dimension, every tensor a record implies
is present with the shape and dtype the period implies, codebooks are valid,
one for the job in v2 and v3, v1's source shards tile each parameter), its
rows in ``ckpt inspect``, its line in ``ckpt verify`` and the entries an
optimizer writes (``kinds.PlannedEntries``, the scale plan's). What needs the
live model (the parameters' shapes, the mesh's cuts, ``deterministic``) stays
with its state adapters (``sharded``, ``per_rank``). A kind whose state is Gefen's
under records of its own (a test's kind) builds its description here with its
own names, and its two key rows with them (``gefen/{record_kind}/{opt}``,
``gefen/{codebook_kind}/{opt}``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gefen_titan.checkpoint import report_text as text
from gefen_titan.checkpoint.format import schema, schema_records
from gefen_titan.checkpoint.format.kinds import (
    CODEBOOKS,
    RECORD_TENSORS,
    RECORDS,
    InspectView,
    KindDescription,
    KindRecords,
    PlannedEntries,
    PlannedParam,
    Problem,
    RecordsInput,
    check_codebooks,
    check_tensor,
)
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.optim.kinds.gefen import records_v1

__all__ = ["GefenParam", "GefenOptimizer", "description"]



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
    ranks: dict[int, records_v1.V1RankRow] = field(default_factory=dict)
    factored: bool = False  # v4: its second moment is factored (vrow, vcol)

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


def _hyper_problem(fqn: str, group: dict[str, Any]) -> str | None:
    try:
        gefen_records.check_hyper(fqn, group)
    except schema.FormatError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ v2, v3
def _read_agreed(inp: RecordsInput, problems: list[Problem], name: str, record_kind: str, codebook_kind: str,
                 record_type: Any) -> KindRecords:
    if inp.header.blocking != "agreed":
        problems.append((RECORDS, schema.header_key(), f"v{inp.header.version} header {inp.header.to_json()} does "
                                                       "not say blocking \"agreed\""))
    out = KindRecords(name, [], tensor_kinds=frozenset(gefen_keys.param_key_kinds(inp.header.version)))
    for rec_name in inp.names_of(record_kind):
        opt_id = inp.parsed[rec_name].name
        try:
            rec = record_type.from_json(inp.values[rec_name], opt_id)
        except schema.FormatError as e:
            problems.append((RECORDS, rec_name, str(e)))
            continue
        o = GefenOptimizer(opt_id, [GefenParam(p.fqn, p.shape, p.group, p.period, p.step, p.vmean_step,
                                               factored=p.factored) for p in rec.params],
                           rec.global_step, rec.deterministic)
        out.optimizers.append(o)
        for p in o.params:
            if p.fqn in out.owner:
                problems.append((RECORDS, rec_name, f"{p.fqn} has records in {out.owner[p.fqn]} and {rec_name}"))
            out.owner[p.fqn] = rec_name
            problems += [(c, rec_name, w) for c, w in _check_agreed_param(inp.entries, p, o.global_step,
                                                                           inp.header.version) if w]
    books = inp.names_of(codebook_kind)
    check_codebooks(books, inp.values, f"{name} codebook" if name != "Gefen" else "codebook", out.codebooks,
                    problems)
    if any(p.period for p in out.params) and not books:
        problems.append((CODEBOOKS, schema.header_key(), f"the checkpoint holds {name} state but no codebook "
                                                         "(truncated?)"))
    return out


def _check_agreed_param(entries: dict[str, Any], p: GefenParam, global_step: int,
                        version: int) -> list[tuple[str, str | None]]:
    out = [(RECORDS, gefen_records.check_counters(p.fqn, p.period, p.step, p.vmean_step, global_step)),
           (RECORDS, _hyper_problem(p.fqn, p.group))]
    if not p.period:
        return out
    if p.shape and p.shape[-1] % p.period:
        return out + [(RECORDS, f"{p.fqn}: period {p.period} does not divide the last dimension of {p.shape}")]
    if p.period != 1 and len(p.shape) < 2:
        out.append((RECORDS, f"{p.fqn}: period {p.period} on a {len(p.shape)}-D parameter (agreed blocking uses 1)"))
    try:
        specs = gefen_keys.param_tensor_specs(p.fqn, p.shape, p.period, version, p.factored)
    except schema.FormatError as e:
        return out + [(RECORDS, f"{p.fqn}: {e}")]
    for key, (dtype, shape) in specs.items():
        why = f"the shape of {p.fqn}" if dtype == torch.uint8 else f"period {p.period} of {p.fqn}"
        out.append((RECORD_TENSORS, check_tensor(entries, key, shape, dtype, why)))
    return out


# ------------------------------------------------------------------ v1
def _read(inp: RecordsInput, problems: list[Problem]) -> KindRecords:
    if inp.header.version in schema.AGREED_VERSIONS:
        return _read_agreed(inp, problems, "Gefen", "gefen", "codebook", gefen_records.OptimizerRecord)
    out = KindRecords("Gefen", [])
    for name in inp.names_of("gefen"):
        opt_id = inp.parsed[name].name
        try:
            meta = records_v1.V1OptimizerRecord.from_json(inp.values[name], opt_id)
        except schema.FormatError as e:
            problems.append((RECORDS, name, str(e)))
            continue
        o = GefenOptimizer(opt_id, [GefenParam(p.fqn, p.shape, p.group) for p in meta.params], nshards=meta.nshards)
        out.optimizers.append(o)
        for label in range(o.nshards):
            problems += _read_v1_rank(inp.entries, inp.values, o, label, out.codebooks)
        for p in o.params:
            out.owner[p.fqn] = name
            why = _hyper_problem(p.fqn, p.group)
            if why:
                problems.append((RECORDS, name, why))
            codes = gefen_keys.codes_key(p.fqn)
            why = check_tensor(inp.entries, codes, p.shape, torch.uint8, f"the shape of {p.fqn}")
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
    return out


def _read_v1_rank(entries: dict[str, Any], values: dict[str, Any], o: GefenOptimizer, label: int,
                  codebooks: dict[str, torch.Tensor]) -> list[Problem]:
    rk = gefen_keys.records_key(o.opt, label)
    if rk not in values:
        return [(RECORDS, rk, f"records of source rank {label} of optimizer {o.opt} missing (truncated checkpoint?)")]
    try:
        global_step, rows = records_v1.read_v1_rank_table(values[rk], len(o.params), rk)
    except schema.FormatError as e:
        return [(RECORDS, rk, str(e))]
    bk = entries.get(gefen_keys.blocks_key(o.opt, label))
    block_rows = bk.size[0] if isinstance(bk, TensorStorageMetadata) and len(bk.size) else -1
    o.global_step = max(o.global_step, global_step)
    out: list[Problem] = []
    for p, row in zip(o.params, rows, strict=True):
        p.ranks[label] = row
        for why in (row.check(p.fqn, label, block_rows),
                    gefen_records.check_counters(p.fqn, row.period, row.step, row.vmean_step, global_step)):
            if why:
                out.append((RECORDS, rk, why if why.startswith(f"{p.fqn}: source rank")
                            else f"source rank {label}: {why}"))
    ck_name = gefen_keys.rank_codebook_key(o.opt, label)
    if any(row.period for row in rows):
        if ck_name not in values:
            out.append((CODEBOOKS, ck_name, f"codebook of source rank {label} for optimizer {o.opt} missing"))
        else:
            try:
                codebooks[ck_name] = schema_records.check_codebook(values[ck_name], f"codebook {ck_name}")
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


# ------------------------------------------------------------------ the offline tools
def _summary(state: KindRecords, version: int) -> dict[str, Any]:
    return {"version": version, "optimizers": len(state.optimizers), "params": len(state.params),
            "codebooks": len(state.codebooks)}


def _summary_line(name: str):
    def line(s: dict[str, Any]) -> str:
        what = "grids" if s["version"] in schema.AGREED_VERSIONS else "per-rank blocks tile every parameter"
        return (f"{name} v{s['version']}: {s['params']} parameters in {s['optimizers']} optimizer record(s), "
                f"{s['codebooks']} codebook(s): records, {what} and codebooks valid")
    return line


def _rows(name: str, record_kind: str, codebook_kind: str):
    def rows(view: InspectView, state: KindRecords, version: int) -> list[dict[str, Any]]:
        agreed = version in schema.AGREED_VERSIONS
        books = view.load(list(state.codebooks)) if state.codebooks else {}
        out = []
        for o in state.optimizers:
            params = []
            for p in o.params:
                names = (list(gefen_keys.param_tensor_keys(p.fqn, version, p.factored).values()) if agreed
                         else [gefen_keys.codes_key(p.fqn)])
                row = {"fqn": p.fqn, "shape": list(p.shape), "period": p.period, "step": p.step,
                       "vmean_step": p.vmean_step, "group": p.group, **view.tensors(names)}
                if p.factored:
                    row["second_moment"] = "factored"
                if agreed:
                    row["grid"] = list(p.grid) if p.grid else None
                else:  # per source rank: its own period (v1)
                    row["periods_by_rank"] = {str(r): v.period for r, v in sorted(p.ranks.items())}
                    row["bytes"] += 8 * sum(v.nblocks for v in p.ranks.values())
                params.append(row)
            if agreed:
                cb_names = [schema.entry_key(codebook_kind, o.opt)]
                shared = [schema.entry_key(record_kind, o.opt)]
            else:
                cb_names = [gefen_keys.rank_codebook_key(o.opt, r) for r in range(o.nshards)]
                shared = ([gefen_keys.optimizer_key(o.opt)]
                          + [gefen_keys.records_key(o.opt, r) for r in range(o.nshards)]
                          + [gefen_keys.blocks_key(o.opt, r) for r in range(o.nshards)])
            row = view.optimizer_row(name, o, params, [n for n in cb_names if n in books], shared + cb_names,
                                     {} if agreed else {"source_ranks": o.nshards})
            row["records"] = shared[0]
            out.append(row)
        return out
    return rows


def _group(g: dict) -> str:
    # Gefen's records keep beta1/beta2: shown as torch's betas.
    return text.hyper_line({"lr": g.get("lr"), "betas": [g.get("beta1"), g.get("beta2")], "eps": g.get("eps"),
                            "weight_decay": g.get("weight_decay")})


def _render(o: dict[str, Any]) -> list[str]:
    extra = f", {o['source_ranks']} source rank(s)" if "source_ranks" in o else ""
    det = "" if o["deterministic"] is None else f", deterministic {str(o['deterministic']).lower()}"
    lines = [f"optimizer   {o['kind']} (records {o['records']}): {len(o['params'])} parameters, "
             f"global step {o['global_step']}{det}{extra}"]
    lines += [f"  {_group(g)}" for g in o["hyperparameters"]]
    lines += [text.codebook_line(name, cb) for name, cb in o["codebooks"].items()]
    v2 = o["format_version"] in schema.AGREED_VERSIONS
    head = ["parameter", "shape", "period" if v2 else "periods", "grid" if v2 else "", "step", "bytes", "chunks"]
    rows = [[p["fqn"], text.shape(p["shape"]),
             str(p["period"]) if v2 else ",".join(str(x) for x in sorted(set(p["periods_by_rank"].values()))),
             text.shape(p["grid"]) if v2 and p["grid"] else ("-" if v2 else ""),
             str(p["step"]), text.count(p["bytes"]), "x".join(map(str, p["cuts"])) or "1"] for p in o["params"]]
    return lines + text.table(head, rows)


def _planned(record_kind: str, codebook_kind: str, record_type: Any) -> PlannedEntries:
    """``GefenShardedAdapter``'s entries: per parameter its codes and block grid (a factored one's also its
    rows and columns), then the optimizer's record (every parameter's period and counters, ``vmean_step`` =
    ``step``) and its codebook. A parameter's ``options["second_moment"]`` (absent: factored, the default's
    under agreed blocking) says which; a vector's is block whatever it says (``factored.is_factored``)."""
    def factored(p: PlannedParam) -> bool:
        return p.options.get("second_moment", "factored") == "factored" and len(p.shape) >= 2

    def optimizer_entries(opt: str, params: list[PlannedParam], step: int, deterministic: bool) -> dict[str, Any]:
        records = [gefen_records.ParamRecord(p.fqn, p.shape, p.period, p.step, p.step, p.group, factored(p))
                   for p in params]
        return {schema.entry_key(record_kind, opt): record_type(deterministic, step, records).to_json(),
                schema.entry_key(codebook_kind, opt): (torch.float32, (schema.K,))}
    return PlannedEntries(lambda p: gefen_keys.param_tensor_specs(p.fqn, p.shape, p.period, factored=factored(p)),
                          optimizer_entries)


def description(name: str = "Gefen", record_kind: str = "gefen", codebook_kind: str = "codebook",
                record_type: Any = gefen_records.OptimizerRecord) -> KindDescription:
    """Gefen's description; with other names, that of a kind keeping Gefen's state under records of
    its own (agreed blocking only: formats v2 and v3)."""
    if name == "Gefen":
        read, versions, rows, docs = _read, frozenset(schema.VERSIONS), gefen_keys.ROWS, gefen_keys.KEY_DOCS
    else:
        def read(inp: RecordsInput, problems: list[Problem]) -> KindRecords:
            return _read_agreed(inp, problems, name, record_kind, codebook_kind, record_type)
        versions, docs = frozenset(schema.AGREED_VERSIONS), {}
        rows = (schema.KeyRow(record_kind, f"gefen/{record_kind}/{{opt}}", small="str"),
                schema.KeyRow(codebook_kind, f"gefen/{codebook_kind}/{{opt}}", small="tensor"))
    return KindDescription(
        name=name, key_rows=rows, key_docs=docs, read=read, versions=versions,
        nonnegative=(frozenset({"magnitude", "vmean", "grid", "blocks", "vrow", "vcol"}) if name == "Gefen"
                     else frozenset()),
        report_key=name.lower(), summary=_summary, summary_line=_summary_line(name),
        rows=_rows(name, record_kind, codebook_kind), render=_render,
        planned_entries=_planned(record_kind, codebook_kind, record_type))
