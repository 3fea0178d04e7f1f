"""GefenMuon's state in a checkpoint, described for the records stage and the offline tools (formats v2, v3).

``DESCRIPTION`` is GefenMuon's ``kinds.KindDescription`` (its registry
entry's ``checkpoint``): its records parse, their group keys and counters
are GefenMuon's, its codebooks are valid and one for the job, every stateful
parameter has the codes, magnitudes and (with NorMuon state) rows its record
implies; its rows in ``ckpt inspect`` (a grouped experts' weight ``(E, out,
in)`` is E Muon matrices), its line in ``ckpt verify``, and why ``ckpt
convert`` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gefen_titan.checkpoint import report_text as text
from gefen_titan.checkpoint.format import kinds, schema
from gefen_titan.optim.kinds.gefen_muon import keys as muon_keys
from gefen_titan.optim.kinds.gefen_muon.records import (
    KIND,
    MuonOptimizerRecord,
    MuonParamRecord,
    check_muon_counters,
    check_muon_hyper,
    muon_tensor_specs,
)

__all__ = ["DESCRIPTION", "MuonOptimizer"]

_TENSOR_KINDS, _RECORD_KIND, _CODEBOOK_KIND = muon_keys.TENSOR_KINDS, muon_keys.RECORD_KIND, muon_keys.CODEBOOK_KIND
# GefenMuon's group keys the table shows (--json has every key the record holds).
_SHOWN = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn", "normuon")


@dataclass
class MuonOptimizer:
    """``gefen/muon/{opt}``, one GefenMuon optimizer's parameters in order."""

    opt: str  # the first parameter's name (the record's key)
    params: list[MuonParamRecord]
    global_step: int
    deterministic: bool


def _read(inp: kinds.RecordsInput, problems: list[kinds.Problem]) -> kinds.KindRecords:
    out = kinds.KindRecords(KIND, [], tensor_kinds=_TENSOR_KINDS)
    for name in inp.names_of(_RECORD_KIND):
        opt_id = inp.parsed[name].name
        try:
            rec = MuonOptimizerRecord.from_json(inp.values[name], opt_id)
        except schema.FormatError as e:
            problems.append((kinds.RECORDS, name, str(e)))
            continue
        out.optimizers.append(MuonOptimizer(opt_id, rec.params, rec.global_step, rec.deterministic))
        for p in rec.params:
            if p.fqn in out.owner:
                problems.append((kinds.RECORDS, name, f"{p.fqn} has records in {out.owner[p.fqn]} and {name}"))
            out.owner[p.fqn] = name
            problems += [(c, name, w) for c, w in _check_param(inp.entries, p, rec.global_step) if w]
    books = inp.names_of(_CODEBOOK_KIND)
    kinds.check_codebooks(books, inp.values, f"{KIND} codebook", out.codebooks, problems)
    if any(p.period for p in out.params) and not books:
        problems.append((kinds.CODEBOOKS, schema.header_key(), f"the checkpoint holds {KIND} state but no codebook "
                                                         "(truncated?)"))
    return out


def _check_param(entries: dict[str, Any], p: MuonParamRecord, global_step: int) -> list[tuple[str, str | None]]:
    try:
        check_muon_hyper(p.fqn, p.group)
        hyper = None
    except schema.FormatError as e:
        hyper = str(e)
    counters = check_muon_counters(p.fqn, p.period, p.step, p.rows_step, global_step)
    out = [(kinds.RECORDS, counters), (kinds.RECORDS, hyper)]
    if not p.period or counters:
        return out
    if len(p.shape) < 2 or p.shape[-1] % p.period:
        return out + [(kinds.RECORDS, f"{p.fqn}: period {p.period} does not fit the {KIND} matrix of shape {p.shape}")]
    rows_key = muon_keys.muon_tensor_keys(p.fqn)["rows"]
    for key, (dtype, shape) in muon_tensor_specs(p.fqn, p.shape, p.period, p.rows_step > 0).items():
        why = (f"the shape of {p.fqn}" if dtype == torch.uint8 else
               f"rows_step {p.rows_step} of {p.fqn}" if key == rows_key else f"period {p.period} of {p.fqn}")
        out.append((kinds.RECORD_TENSORS, kinds.check_tensor(entries, key, shape, dtype, why)))
    return out


# ------------------------------------------------------------------ the offline tools
def _summary(state: kinds.KindRecords, version: int) -> dict[str, Any]:
    return {"version": version, "optimizers": len(state.optimizers), "params": len(state.params),
            "stateful_params": sum(1 for p in state.params if p.period), "codebooks": len(state.codebooks)}


def _summary_line(s: dict[str, Any]) -> str:
    return (f"{KIND} v{s['version']}: {s['params']} parameters in {s['optimizers']} record(s), {s['codebooks']} "
            "codebook(s): records, group keys, counters, codes, magnitudes, NorMuon rows and codebooks valid")


def _grouped(shape) -> bool:
    return len(shape) == 3  # a grouped experts' weight (E, out, in): one Muon matrix per expert


def _rows(view: kinds.InspectView, state: kinds.KindRecords, version: int) -> list[dict[str, Any]]:
    books = view.load(list(state.codebooks)) if state.codebooks else {}
    out = []
    for o in state.optimizers:
        params = [{"fqn": p.fqn, "shape": list(p.shape), "period": p.period,
                   "grid": list(p.grid) if p.period and p.shape and not p.shape[-1] % p.period else None,
                   "matrices": p.shape[0] if _grouped(p.shape) else 1, "matrix_shape": list(p.shape[-2:]),
                   "step": p.step, "rows_step": p.rows_step, "group": p.group,
                   **view.tensors(list(muon_keys.muon_tensor_keys(p.fqn).values()))} for p in o.params]
        cb_names = [schema.entry_key(_CODEBOOK_KIND, o.opt)]
        row = view.optimizer_row(KIND, o, params, [n for n in cb_names if n in books],
                                 [schema.entry_key(_RECORD_KIND, o.opt), *cb_names], {})
        row["records"] = schema.entry_key(_RECORD_KIND, o.opt)
        out.append(row)
    return out


def _render(o: dict[str, Any]) -> list[str]:
    grouped = [p for p in o["params"] if _grouped(p["shape"])]
    matrices, expert = sum(p["matrices"] for p in o["params"]), sum(p["matrices"] for p in grouped)
    experts = f" ({matrices} Muon matrices, {expert} of them experts of {len(grouped)} grouped weights)" \
        if grouped else ""
    lines = [f"optimizer   {KIND} (records {o['records']}): {len(o['params'])} parameters{experts}, global step "
             f"{o['global_step']}, deterministic {str(o['deterministic']).lower()}"]
    lines += ["  " + "  ".join(f"{k} {text.value(g.get(k))}" for k in _SHOWN) for g in o["hyperparameters"]]
    lines += [text.codebook_line(name, cb) for name, cb in o["codebooks"].items()]
    rows = [[p["fqn"], text.shape(p["shape"]), str(p["period"]), text.shape(p["grid"]) if p["grid"] else "-",
             str(p["step"]), str(p["rows_step"]), text.count(p["bytes"]), "x".join(map(str, p["cuts"])) or "1"]
            + ([f"{p['matrices']} x {text.shape(p['matrix_shape'])}"] if grouped else []) for p in o["params"]]
    return lines + text.table(["parameter", "shape", "period", "grid", "step", "rows_step", "bytes", "chunks"]
                              + (["Muon matrices"] if grouped else []), rows)


DESCRIPTION = kinds.KindDescription(
    name=KIND, key_rows=muon_keys.ROWS, key_docs=muon_keys.KEY_DOCS, read=_read,
    versions=frozenset(schema.AGREED_VERSIONS), nonnegative=frozenset({"muon_magnitude", "muon_rows"}),
    report_key="gefen_muon", summary=_summary, summary_line=_summary_line, rows=_rows, render=_render,
    convert_refusal=(f"{KIND}'s momentum (with NorMuon's per-row second moment) has no AdamW equivalent, and "
                     "torch's Muon keeps no NorMuon rows. Resume it with a GefenMuon recipe (e.g. "
                     "recipes/llama_gefen_muon.toml), or start the optimizer fresh with "
                     "checkpoint.exclude_from_loading = [\"optimizer\"]"))
