"""Gefen's records in a checkpoint, read and checked offline (formats v2 and v1).

The checks are those of a load (``reshard/agreed.py``, ``reshard/adapter.py``)
that do not need the live model: every record parses, counters add up,
hyperparameters are ones Gefen can represent, periods divide the last
dimension, every tensor the records imply is present with the shape and
dtype the period implies, codebooks are valid (and one for the job in v2),
v1 source shards tile each parameter. Each problem names the entry it is
about, so ``verify`` can name the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from gefen_titan.checkpoint import schema as fmt
from gefen_titan.checkpoint.errors import GefenCheckpointError, check_codebook, check_hyper
from gefen_titan.checkpoint.reader import OPTIMIZER, Checkpoint, CkptError
from gefen_titan.checkpoint.schema import grid_shape

__all__ = ["GefenParam", "GefenOptimizer", "GefenState", "read_gefen", "codebook_summary"]


@dataclass
class GefenParam:
    fqn: str
    shape: tuple[int, ...]
    group: dict[str, float]
    # v2: one period and counter pair; v1: per source rank (label -> values)
    period: int = 0
    step: int = 0
    vmean_step: int = 0
    ranks: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def grid(self) -> tuple[int, ...] | None:
        return grid_shape(self.shape, self.period) if self.period else None


@dataclass
class GefenOptimizer:
    opt: str  # the first parameter's name (the records' key)
    params: list[GefenParam]
    global_step: int = 0
    deterministic: bool | None = None  # v2 only
    nshards: int = 1  # v1 only: source ranks


@dataclass
class GefenState:
    version: int
    header: dict
    optimizers: list[GefenOptimizer]
    codebooks: dict[str, torch.Tensor]  # entry name -> codebook
    problems: list[tuple[str, str]]  # (entry name inside "optimizer.", what is wrong)

    @property
    def params(self) -> list[GefenParam]:
        return [p for o in self.optimizers for p in o.params]


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


def read_gefen(ck: Checkpoint) -> GefenState | None:
    """The checkpoint's Gefen state records (None: it holds no Gefen state).

    Raises ``CkptError`` when the header is unreadable or of an unknown
    format; everything else wrong is collected in ``problems``.
    """
    header = ck.gefen_header()
    if header is None:
        return None
    version = header.get("version")
    if header.get("format") != fmt.FORMAT or version not in (fmt.V1, fmt.VERSION):
        raise CkptError(f"{ck.path}: Gefen header {header} is not {fmt.FORMAT} v{fmt.V1} or v{fmt.VERSION}: it was "
                        "written by another gefen-titan version; inspect it with that version")
    return _read_v2(ck, header) if version == fmt.VERSION else _read_v1(ck, header)


def _json(raw: Any, what: str) -> Any:
    if not isinstance(raw, str):
        raise ValueError(f"{what} is {type(raw).__name__}, not a JSON string")
    return json.loads(raw)


def _check_counters(fqn: str, period: int, step: int, vstep: int, global_step: int) -> str | None:
    if period < 0 or step < 0 or vstep < 0 or vstep > step or (period == 0) != (step == 0):
        return f"{fqn}: counters do not add up (period {period}, step {step}, vmean_step {vstep})"
    if step > global_step:
        return f"{fqn}: global step {global_step} < parameter step {step}"
    return None


def _check_tensor(ck_opt: dict, name: str, shape: tuple, dtype: torch.dtype, why: str) -> str | None:
    e = ck_opt.get(name)
    if e is None:
        return f"{name} missing ({why}): the checkpoint is truncated or was edited"
    if not e.is_tensor or tuple(e.shape) != tuple(shape) or e.dtype != dtype:
        got = f"{e.dtype} {tuple(e.shape)}" if e.is_tensor else "a non-tensor"
        return f"{name} is {got}, expected {dtype} {tuple(shape)} ({why})"
    return None


# ------------------------------------------------------------------ v2
def _read_v2(ck: Checkpoint, header: dict) -> GefenState:
    opt = ck.optimizer
    rec_names = [n for n in opt if n.startswith(fmt.PREFIX + "optimizer/")]
    book_names = [n for n in opt if n.startswith(fmt.PREFIX + "codebook/") and n.count("/") == 2]
    values = ck.load_names(OPTIMIZER, rec_names + book_names)
    problems: list[tuple[str, str]] = []
    if header.get("blocking") != "agreed":
        problems.append((fmt.format_key(), f"v2 header {header} does not say blocking \"agreed\""))
    optimizers, seen = [], {}
    for name in rec_names:
        opt_id = name[len(fmt.PREFIX + "optimizer/"):]
        try:
            rec = _json(values[name], name)
            if rec.get("blocking") != "agreed":
                raise ValueError("not an agreed-blocking record")
            o = GefenOptimizer(opt_id, [], int(rec["global_step"]), bool(rec["deterministic"]))
            for p in rec["params"]:
                gp = GefenParam(str(p["fqn"]), tuple(int(s) for s in p["shape"]), dict(p["group"]),
                                int(p["period"]), int(p["step"]), int(p["vmean_step"]))
                o.params.append(gp)
        except (ValueError, KeyError, TypeError) as e:
            what = f"field {e} missing" if isinstance(e, KeyError) else str(e)
            problems.append((name, f"optimizer record {opt_id} is corrupt ({what})"))
            continue
        optimizers.append(o)
        for p in o.params:
            if p.fqn in seen:
                problems.append((name, f"{p.fqn} has records in {seen[p.fqn]} and {opt_id}"))
            seen[p.fqn] = opt_id
            problems += [(name, w) for w in _check_v2_param(opt, p, o.global_step) if w]
    codebooks = {}
    for name in book_names:
        try:
            codebooks[name] = check_codebook(values[name], f"codebook {name}")
        except GefenCheckpointError as e:
            problems.append((name, str(e)))
    books = list(codebooks.items())
    for name, cb in books[1:]:
        if not torch.equal(books[0][1], cb):
            problems.append((name, f"the codebooks disagree ({books[0][0]} != {name}); an agreed checkpoint has "
                                   "one codebook for the job"))
    if any(p.period for o in optimizers for p in o.params) and not codebooks and not book_names:
        problems.append((fmt.format_key(), "the checkpoint holds Gefen state but no codebook (truncated?)"))
    for name in opt:
        for kind in ("codes/", "magnitude/", "vmean/"):
            if name.startswith(fmt.PREFIX + kind) and name[len(fmt.PREFIX + kind):] not in seen:
                problems.append((name, f"{name} belongs to no optimizer record"))
    return GefenState(2, header, optimizers, codebooks, problems)


def _check_v2_param(opt: dict, p: GefenParam, global_step: int) -> list[str | None]:
    out = [_check_counters(p.fqn, p.period, p.step, p.vmean_step, global_step)]
    try:
        check_hyper(p.fqn, p.group)
    except (GefenCheckpointError, KeyError) as e:
        out.append(str(e) if not isinstance(e, KeyError) else f"{p.fqn}: hyperparameter {e} missing")
    if not p.period:
        return out
    if p.shape and p.shape[-1] % p.period:
        return out + [f"{p.fqn}: period {p.period} does not divide the last dimension of {p.shape}"]
    if p.period != 1 and len(p.shape) < 2:
        out.append(f"{p.fqn}: period {p.period} on a {len(p.shape)}-D parameter (agreed blocking uses 1)")
    why = f"period {p.period} of {p.fqn}"
    out.append(_check_tensor(opt, fmt.codes_key(p.fqn), p.shape, torch.uint8, f"the shape of {p.fqn}"))
    for key in (fmt.magnitude_key(p.fqn), fmt.vmean_key(p.fqn)):
        out.append(_check_tensor(opt, key, p.grid, torch.float32, why))
    return out


# ------------------------------------------------------------------ v1
def _read_v1(ck: Checkpoint, header: dict) -> GefenState:
    opt = ck.optimizer
    meta_names = [n for n in opt if n.startswith(fmt.PREFIX + "optimizer/")]
    small = [n for n in opt if n.startswith((fmt.PREFIX + "records/", fmt.PREFIX + "codebook/"))]
    values = ck.load_names(OPTIMIZER, meta_names + small)
    problems: list[tuple[str, str]] = []
    optimizers, codebooks = [], {}
    for name in meta_names:
        opt_id = name[len(fmt.PREFIX + "optimizer/"):]
        try:
            meta = _json(values[name], name)
            o = GefenOptimizer(opt_id, [GefenParam(str(p["fqn"]), tuple(int(s) for s in p["shape"]), dict(p["group"]))
                                        for p in meta["params"]], nshards=int(meta["nshards"]))
        except (ValueError, KeyError, TypeError) as e:
            problems.append((name, f"optimizer record {opt_id} is corrupt ({e})"))
            continue
        optimizers.append(o)
        for label in range(o.nshards):
            problems += _read_v1_rank(opt, values, o, label, codebooks)
        for p in o.params:
            try:
                check_hyper(p.fqn, p.group)
            except (GefenCheckpointError, KeyError) as e:
                problems.append((name, str(e)))
            problems += [(fmt.codes_key(p.fqn), w) for w in
                         [_check_tensor(opt, fmt.codes_key(p.fqn), p.shape, torch.uint8, f"the shape of {p.fqn}")] if w]
            problems += [(name, w) for w in _check_v1_tiling(p) if w]
            steps = {r["step"] for r in p.ranks.values() if r["length"]}
            if len(steps) > 1:
                problems.append((name, f"{p.fqn}: source ranks disagree on the step count {sorted(steps)}"))
            p.step = max(steps, default=0)
            p.vmean_step = max((r["vmean_step"] for r in p.ranks.values()), default=0)
            periods = {r["period"] for r in p.ranks.values() if r["period"]}
            p.period = periods.pop() if len(periods) == 1 else 0
    return GefenState(1, header, optimizers, codebooks, problems)


def _read_v1_rank(opt: dict, values: dict, o: GefenOptimizer, label: int, codebooks: dict) -> list[tuple[str, str]]:
    rk = fmt.records_key(o.opt, label)
    table = values.get(rk)
    if table is None:
        return [(rk, f"records of source rank {label} of optimizer {o.opt} missing (truncated checkpoint?)")]
    if tuple(table.shape) != (1 + len(o.params), 7):
        return [(rk, f"{rk} has shape {tuple(table.shape)}, expected {(1 + len(o.params), 7)}")]
    bk = opt.get(fmt.blocks_key(o.opt, label))
    rows = bk.shape[0] if bk is not None and bk.is_tensor else -1
    global_step = int(table[0, 0])
    o.global_step = max(o.global_step, global_step)
    out: list[tuple[str, str]] = []
    stateful = False
    for i, p in enumerate(o.params):
        start, length, period, step, vstep, block0, nblocks = (int(x) for x in table[1 + i].tolist())
        p.ranks[label] = dict(zip(fmt.RECORD_FIELDS, (start, length, period, step, vstep, block0, nblocks)))
        if (period < 0 or (period and (length % period or nblocks != length // period))
                or (not period and nblocks) or block0 < 0 or block0 + nblocks > rows):
            out.append((rk, f"{p.fqn}: source rank {label} has inconsistent blocks (length {length}, period "
                            f"{period}, blocks {block0}+{nblocks} of {rows})"))
        why = _check_counters(p.fqn, period, step, vstep, global_step)
        if why:
            out.append((rk, f"source rank {label}: {why}"))
        stateful = stateful or bool(period)
    ck_name = fmt.codebook_key(o.opt, label)
    if stateful:
        if ck_name not in values:
            out.append((ck_name, f"codebook of source rank {label} for optimizer {o.opt} missing"))
        else:
            try:
                codebooks[ck_name] = check_codebook(values[ck_name], f"codebook {ck_name}")
            except GefenCheckpointError as e:
                out.append((ck_name, str(e)))
    return out


def _check_v1_tiling(p: GefenParam) -> list[str | None]:
    numel = 1
    for s in p.shape:
        numel *= s
    pos = 0
    for r in sorted(p.ranks.values(), key=lambda r: r["start"]):
        if r["length"] and r["start"] != pos:
            return [f"{p.fqn}: source shards do not tile the parameter (gap or overlap at element {pos})"]
        pos = r["start"] + r["length"] if r["length"] else pos
    if pos != numel:
        return [f"{p.fqn}: source shards cover {pos} of {numel} elements"]
    return []
