"""``gefen-titan ckpt inspect``: what a checkpoint holds, from its metadata and small entries.

Reads the DCP metadata, every kind's records and codebooks, the counters and
the data loader's small values; never the large tensors. What it can say
about the mesh the checkpoint was saved on is what the files record: the
ranks that wrote data files, the data loader's per-rank entries (the
data-parallel degree), and how each optimizer tensor was cut into chunks
(DCP writes one chunk per distinct shard, so replicas, such as HSDP's, and
pipeline stages are not visible as such). Each optimizer kind's rows and
their text are its own (``checkpoint.format.kinds.KindDescription.rows``,
``render``); torch's flat optimizers' are this module's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torchtitan.components.checkpoint import MODEL, OPTIMIZER

from gefen_titan.checkpoint import report_text as text
from gefen_titan.checkpoint.format import digests, kinds, schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.saved_records import SavedRecords, codebook_summary, read_records
from gefen_titan.ckpt_tools.view import Checkpoint, CkptError, Entry, split_state_key

__all__ = ["inspect_checkpoint", "render"]

_TORCH_KINDS = {("exp_avg", "exp_avg_sq", "step"): "Adam/AdamW", ("momentum_buffer",): "SGD"}
_COUNTERS = (("train_state", "step"), ("train_state", "ntokens_seen"), ("lr_scheduler", "last_epoch"),
             ("dataloader", "world_size"))


def _cuts(e: Entry) -> list[int]:
    """Distinct chunk offsets per dimension: how many pieces each dim was cut into."""
    if not e.is_tensor or not e.shape:
        return []
    return [len({off[d] for off, size in e.chunks if size[d]}) or 1 for d in range(len(e.shape))]


def _small_values(ck: Checkpoint) -> dict[str, Any]:
    keys = [ck.component(c)[n].key for c, n in _COUNTERS if n in ck.component(c)]
    values = ck.load(keys)
    return {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool))}


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """The report ``inspect`` prints (``--json`` prints exactly this)."""
    ck = Checkpoint(path)
    opt = ck.optimizer
    # What the load's metadata stage refuses is flagged, and nothing is then read: a read would
    # allocate what the metadata claims (load_checks).
    malformed = [f"{p} [{p.check}]" for p in ck.problems]
    saved = read_records(ck) if not malformed else None
    files = [{"name": n, "bytes": _file_bytes(ck, n)} for n in ck.data_files()]
    report: dict[str, Any] = {
        "path": ck.path,
        "format": _format(saved),
        "files": files,
        "total_bytes": sum(f["bytes"] or 0 for f in files),
        "allocation_bytes": ck.allocation,
        "digests": _digests(ck),
        "counters": {},
        "optimizers": [],
        "problems": malformed,
        "warnings": [],
    }
    if not malformed:
        try:  # the counters' read runs the load's entry stage (step binding among them)
            report["counters"] = _small_values(ck)
        except CkptError as e:
            report["problems"].append(str(e))
    if saved is not None:
        report["optimizers"] += _kind_optimizers(ck, saved)
        unknown = set(saved.unknown)
        report["problems"] += [f"{name}: {what}" for check, name, what in saved.checked if (check, name, what)
                               not in unknown]
        # An entry of a kind this version does not know: a load and verify refuse it; inspect shows the rest.
        report["warnings"] = [what for _, _, what in saved.unknown]
    if not malformed:
        report["optimizers"] += _torch_optimizers(ck)
    report["optimizer_totals"] = _totals(report["optimizers"])
    report["mesh"] = _mesh(ck, report["counters"])
    model = [e for e in ck.entries.values() if e.component == MODEL]
    report["model"] = {
        "tensors": len(model),
        "elements": sum(e.numel for e in model if e.is_tensor),
        "bytes": sum(e.payload_bytes for e in model if e.is_tensor),
        "dtypes": dict(Counter(str(e.dtype).replace("torch.", "") for e in model if e.is_tensor)),
    }
    report["other"] = [{"key": e.key, "stored_bytes": e.stored_bytes,
                        **({"shape": list(e.shape), "dtype": str(e.dtype)} if e.is_tensor else {})}
                       for e in ck.entries.values() if e.component not in (MODEL, OPTIMIZER)]
    if not opt:
        report["note"] = "no optimizer state (a model-only checkpoint)"
    return report


def _digests(ck: Checkpoint) -> dict[str, Any]:
    """Whether the checkpoint carries ``.digests`` (loads check every byte) or not (loads unchecked)."""
    try:
        record = storage.read_digests(ck.path)
    except digests.CorruptCheckpointError as e:
        return {"file": digests.FILE, "state": "damaged", "detail": str(e)}
    if record is None:
        return {"file": None, "state": "none"}
    return {"file": digests.FILE, "state": "present", "algorithm": record.algorithm, "items": record.count()}


def _file_bytes(ck: Checkpoint, name: str) -> int | None:
    return storage.file_size(ck.path, name)


def _format(saved: SavedRecords | None) -> dict[str, Any] | None:
    if saved is None:
        return None
    return {"name": schema.FORMAT, "version": saved.version,
            "blocking": saved.header.blocking or ("per_rank" if saved.version == schema.V1 else None)}


class _View:
    """What a kind's rows (``KindDescription.rows``) read through: ``checkpoint.format.kinds.InspectView``."""

    def __init__(self, ck: Checkpoint, version: int) -> None:
        self.ck, self.version = ck, version

    def load(self, names: list[str]) -> dict[str, Any]:
        return self.ck.load_names(OPTIMIZER, names)

    def tensors(self, names: list[str]) -> dict[str, Any]:
        entries = [self.ck.optimizer[n] for n in names if n in self.ck.optimizer]
        return {"bytes": sum(e.payload_bytes for e in entries if e.is_tensor),
                "stored_bytes": sum(e.stored_bytes for e in entries),
                "cuts": _cuts(entries[0]) if entries else []}

    def optimizer_row(self, kind: str, o: Any, params: list[dict[str, Any]], codebooks: list[str],
                      shared: list[str], extra: dict[str, Any]) -> dict[str, Any]:
        """One optimizer's row, whatever its kind: its parameters' rows and what they add up to."""
        books = self.load(codebooks) if codebooks else {}
        cbs = {n: codebook_summary(books[n]) for n in codebooks}
        elements = sum(_numel(p.shape) for p in o.params)
        stored = sum(r["stored_bytes"] for r in params) + sum(self.ck.optimizer[n].stored_bytes for n in shared
                                                              if n in self.ck.optimizer)
        return {
            "kind": kind,
            "id": o.opt,
            "format_version": self.version,
            "global_step": o.global_step,
            "deterministic": o.deterministic,
            **extra,
            "hyperparameters": _unique_groups([p.group for p in o.params]),
            "codebooks": cbs,
            "params": params,
            "elements": elements,
            "bytes": sum(r["bytes"] for r in params) + 4 * 256 * len(cbs),
            "stored_bytes": stored,
            "stored_bytes_per_param": stored / elements if elements else None,
        }


def _kind_optimizers(ck: Checkpoint, saved: SavedRecords) -> list[dict[str, Any]]:
    """Each described kind's rows (``checkpoint.format.kinds``), in registration order."""
    view, out = _View(ck, saved.version), []
    for desc in kinds.descriptions():
        if desc.name in saved.kinds and desc.rows is not None:
            out += desc.rows(view, saved.kinds[desc.name], saved.version)
    return out


def _totals(optimizers: list[dict[str, Any]]) -> dict[str, Any]:
    """Every optimizer's state together (every kind's, torch's)."""
    elements = sum(o["elements"] for o in optimizers)
    stored = sum(o["stored_bytes"] for o in optimizers)
    return {"kinds": [o["kind"] for o in optimizers], "params": sum(len(o["params"]) for o in optimizers),
            "elements": elements, "bytes": sum(o["bytes"] for o in optimizers), "stored_bytes": stored,
            "stored_bytes_per_param": stored / elements if elements else None}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _unique_groups(groups: list[dict]) -> list[dict]:
    out = []
    for g in groups:
        if g not in out:
            out.append(g)
    return out


def _torch_optimizers(ck: Checkpoint) -> list[dict[str, Any]]:
    """torchtitan's flat ``state.{fqn}.*`` / ``param_groups.{fqn}.*`` optimizers (AdamW, ...)."""
    opt = ck.optimizer
    by_fqn: dict[str, dict[str, Entry]] = {}
    for name, e in opt.items():
        split = split_state_key(name)
        if split:
            by_fqn.setdefault(split[0], {})[split[1]] = e
    if not by_fqn:
        return []
    # Hyperparameters and steps: small entries, read in one go.
    keys = []
    for fqn, states in by_fqn.items():
        if "step" in states and states["step"].is_tensor and states["step"].numel == 1:
            keys.append(states["step"].key)
        for h in ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "amsgrad"):
            n = f"param_groups.{fqn}.{h}"
            if n in opt:
                keys.append(opt[n].key)
    values = ck.load(keys)
    kinds: dict[str, list] = {}
    for fqn, states in by_fqn.items():
        names = tuple(sorted(states))
        kind = _TORCH_KINDS.get(names, "torch (" + ", ".join(names) + ")")
        group = {h: values.get(opt[f"param_groups.{fqn}.{h}"].key) for h in
                 ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "amsgrad")
                 if f"param_groups.{fqn}.{h}" in opt}
        if kind == "Adam/AdamW" and "decoupled_weight_decay" in group:
            kind = "AdamW" if group["decoupled_weight_decay"] else "Adam"
        if "betas" in group:
            group["betas"] = list(group["betas"])
        big = next((e for e in states.values() if e.is_tensor and e.shape), None)
        step = values.get(states["step"].key) if "step" in states else None
        kinds.setdefault(kind, []).append({
            "fqn": fqn,
            "shape": list(big.shape) if big else [],
            "state": {n: ({"shape": list(e.shape), "dtype": str(e.dtype).replace("torch.", "")} if e.is_tensor
                          else {}) for n, e in sorted(states.items())},
            "step": float(step) if step is not None else None,
            "group": group,
            "bytes": sum(e.payload_bytes for e in states.values() if e.is_tensor),
            "stored_bytes": sum(e.stored_bytes for e in states.values()),
            "cuts": _cuts(big) if big else [],
        })
    out = []
    for kind, params in kinds.items():
        elements = sum(_numel(p["shape"]) for p in params)
        steps = sorted({p["step"] for p in params if p["step"] is not None})
        out.append({"kind": kind, "params": params, "elements": elements,
                    "steps": steps, "hyperparameters": _unique_groups([p["group"] for p in params]),
                    "bytes": sum(p["bytes"] for p in params),
                    "stored_bytes": sum(p["stored_bytes"] for p in params),
                    "stored_bytes_per_param": sum(p["stored_bytes"] for p in params) / elements if elements else None})
    return out


def _mesh(ck: Checkpoint, counters: dict[str, Any]) -> dict[str, Any]:
    loader = ck.component("dataloader")
    ranks = sorted(int(n[len("dp_rank_"):]) for n in loader if n.startswith("dp_rank_") and n[8:].isdigit())
    sharded = [e for e in ck.optimizer.values() if e.is_tensor and len(e.shape) >= 2] or \
              [e for e in ck.entries.values() if e.component == MODEL and e.is_tensor and len(e.shape) >= 2]
    cuts = [_cuts(e) for e in sharded]
    max_cuts = [max((c[d] for c in cuts if len(c) > d), default=1) for d in range(2)]
    mesh: dict[str, Any] = {
        "writer_ranks": len(ck.writer_ranks()) or len(ck.data_files()),
        "data_parallel_ranks": len(ranks) if ranks else None,
        "data_loader": ("per-rank (torchtitan, dataloader.dp_rank_*)" if ranks else
                        "one global position" if any(n.startswith("global_order") for n in loader) else
                        ("none" if not loader else "other")),
        "max_cuts_dim0": max_cuts[0],
        "max_cuts_dim1": max_cuts[1],
    }
    if counters.get("dataloader.world_size") is not None:
        mesh["data_loader_world_size"] = counters["dataloader.world_size"]
    parts = [f"{mesh['writer_ranks']} rank(s) wrote files"]
    if ranks:
        parts.append(f"data parallel {len(ranks)} (dataloader.dp_rank_"
                     + (f"0..{ranks[-1]})" if len(ranks) > 1 else "0)"))
    parts.append(f"2-D tensors cut into up to {max_cuts[0]} x {max_cuts[1]} chunks (dim 0 x dim 1"
                 + ("; dim-1 cuts are tensor parallel" if max_cuts[1] > 1 else "") + ")")
    mesh["summary"] = "; ".join(parts)
    return mesh


# ------------------------------------------------------------------ text
def _digest_line(d: dict[str, Any]) -> str:
    if d["state"] == "present":
        return (f"{d['file']}: {d['algorithm']} of .metadata and of {d['items']:,} stored items (every load checks "
                "them)")
    if d["state"] == "damaged":
        return f"{d['file']} is damaged: loads refuse this checkpoint (`gefen-titan ckpt verify` says more)"
    return "none: loads read this checkpoint unchecked (`gefen-titan ckpt verify` checks its CRC32s)"


def _mb(x: int | None) -> str:
    return "?" if x is None else f"{x / 1e6:.2f} MB" if x >= 1e5 else f"{x / 1e3:.1f} KB"


def render(report: dict[str, Any]) -> str:
    """The human-readable table of an ``inspect_checkpoint`` report."""
    f = report["format"]
    fmt_line = (f"{f['name']} v{f['version']} ({f['blocking']} blocking)" if f else
                "no gefen-titan state" + (" (torch optimizer state)" if report["optimizers"] else ""))
    c = report["counters"]
    counters = ", ".join(f"{k} {v}" for k, v in c.items() if k != "dataloader.world_size") or "none"
    lines = [
        f"checkpoint  {report['path']}",
        f"format      {fmt_line}",
        f"files       {len(report['files'])} data file(s), {_mb(report['total_bytes'])}: "
        + ", ".join(x["name"] for x in report["files"][:4]) + (" ..." if len(report["files"]) > 4 else ""),
        f"allocation  a full read holds {_mb(report['allocation_bytes'])} in memory (bounded by the files: "
        "checked before anything is read)",
        f"digests     {_digest_line(report['digests'])}",
        f"saved on    {report['mesh']['summary']}",
        f"counters    {counters}",
    ]
    for o in report["optimizers"]:
        lines.append("")
        desc = next((d for d in kinds.descriptions() if d.name == o["kind"] and d.render), None)
        if desc is not None:
            lines += desc.render(o)
        else:
            steps = ", ".join(f"{s:g}" for s in o["steps"]) or "-"
            lines.append(f"optimizer   {o['kind']} (torch state): {len(o['params'])} parameters, step {steps}")
            for g in o["hyperparameters"]:
                lines.append(f"  {text.hyper_line(g)}")
            rows = [[p["fqn"], text.shape(p["shape"]), ", ".join(p["state"]), text.count(p["bytes"]),
                     "x".join(map(str, p["cuts"])) or "1"] for p in o["params"]]
            lines += text.table(["parameter", "shape", "state", "bytes", "chunks"], rows)
        per = o["stored_bytes_per_param"]
        lines.append(f"  total {text.count(o['elements'])} elements, {text.count(o['bytes'])} bytes of state, "
                     f"{text.count(o['stored_bytes'])} on disk" + (f" = {per:.3f} bytes/param" if per else ""))
    t = report["optimizer_totals"]
    if len(report["optimizers"]) > 1:
        per = t["stored_bytes_per_param"]
        lines += ["", f"optimizers  {' + '.join(t['kinds'])}: {t['params']} parameters, "
                      f"{text.count(t['elements'])} elements, "
                      f"{text.count(t['bytes'])} bytes of state, {text.count(t['stored_bytes'])} on disk"
                      + (f" = {per:.3f} bytes/param" if per else "")]
    m = report["model"]
    lines += ["", f"model       {m['tensors']} tensors, {text.count(m['elements'])} elements "
                  f"({', '.join(f'{k} {v}' for k, v in m['dtypes'].items())}), {_mb(m['bytes'])}"]
    other = [f"{o['key']} ({_mb(o['stored_bytes'])})" for o in report["other"]
             if not o["key"].startswith(("train_state.", "lr_scheduler."))]
    if other:
        lines.append(f"other       {', '.join(other[:6])}" + (f" ... ({len(other)})" if len(other) > 6 else ""))
    if report.get("note"):
        lines.append(f"note        {report['note']}")
    for w in report.get("warnings", [])[:5]:
        lines.append(f"WARNING     {w} (a load and `gefen-titan ckpt verify` refuse this checkpoint)")
    for p in report.get("problems", [])[:5]:
        lines.append(f"PROBLEM     {p} (a load refuses this checkpoint; `gefen-titan ckpt verify` lists all)")
    return "\n".join(lines)
