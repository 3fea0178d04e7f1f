"""The parameters K steps after a resume against the uninterrupted run at the target layout.

The issue's measure of a reshard is two facts: the state equal right after
the load (``compare_global`` / ``compare_rank``), and the parameters a few
steps later equal to an uninterrupted run at the target layout up to the
reduction order. This module checks the second, on what every run already
writes: the model-only checkpoint of its last step (``Settings.overrides``:
``--checkpoint.last_save_model_only true``), read through gefen_titan's
checked reader (``gefen_titan.checkpoint.io.storage``: ``.metadata`` checked
before it is unpickled, every item against ``.digests``), entry by entry in
chunks, so a comparison holds two chunks in memory, never two models.

It runs with the global-order loader only. There every run reads the same
global batches at every layout, so the resumed run and the uninterrupted
run at the target layout differ by nothing but the order of the gradient
reductions during the first S steps; the tolerance is measured from the
runs that differ by exactly that (``param_band``, as ``bands.order_band``
measures the loss tolerance). With the elastic loader the resumed run reads
other batches than any uninterrupted run (the unread documents go to M
ranks), so its parameters differ by a data-order effect as large as the
training signal, and a band wide enough for that would catch nothing the
loss band misses.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchtitan.components.checkpoint import DATALOADER, LR_SCHEDULER, OPTIMIZER, TRAIN_STATE

from gefen_titan.checkpoint.io import storage
from gefen_titan.validation.bands import LOSS_K
from gefen_titan.validation.layouts import Side, as_side
from gefen_titan.validation.runs import Run, Settings

__all__ = ["CHUNK_BYTES", "FIGURES", "final_checkpoint", "pair_param_band", "param_band", "param_deviation",
           "param_problems"]

# The figures compared, each with its own measured tolerance.
FIGURES = ("rel_l2", "max_abs")
# Bytes of one side's entries read at a time (the comparison holds two such chunks).
CHUNK_BYTES = 256 << 20
# The components torchtitan nests under their names; the model's entries sit at the top level.
_NOT_MODEL = tuple(f"{c}." for c in (OPTIMIZER, DATALOADER, LR_SCHEDULER, TRAIN_STATE))


def final_checkpoint(run: Run, settings: Settings) -> Path:
    """The run's last checkpoint (step S+K, model only)."""
    return Path(run.folder, "checkpoint", f"step-{settings.total_steps}")


def _model_tensors(path: Path) -> tuple[Any, dict[str, TensorStorageMetadata]]:
    meta = storage.read_metadata(path)  # checked (and restricted) before unpickling, as every read of a checkpoint
    return meta, {k: md for k, md in meta.state_dict_metadata.items()
                  if isinstance(md, TensorStorageMetadata) and not k.startswith(_NOT_MODEL)}


def _read(path: Path, meta: Any, keys: list[str]) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        # DCP warns that it loads in a single process: that is the point here.
        warnings.filterwarnings("ignore", message=".*single process.*")
        return storage.read_small(str(path), meta, "", keys, [])


def param_deviation(got: Path, want: Path, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """The model entries of checkpoint ``got`` against ``want``'s: relative L2
    over all of them (|got - want| / |want|, in float64), the largest
    element difference, how many entries differ at all, and any entry
    missing or of another shape or dtype (``problems``)."""
    meta_got, got_md = _model_tensors(got)
    meta_want, want_md = _model_tensors(want)
    problems = []
    if missing := sorted(set(want_md) - set(got_md)):
        problems.append(f"{len(missing)} model entries missing, e.g. {missing[:3]}")
    if extra := sorted(set(got_md) - set(want_md)):
        problems.append(f"{len(extra)} model entries not in the uninterrupted run's, e.g. {extra[:3]}")
    keys = []
    for k in sorted(set(got_md) & set(want_md)):
        a, b = got_md[k], want_md[k]
        if tuple(a.size) != tuple(b.size) or a.properties.dtype != b.properties.dtype:
            problems.append(f"{k}: {tuple(a.size)} {a.properties.dtype} != {tuple(b.size)} {b.properties.dtype}")
        else:
            keys.append(k)
    diff_sq = want_sq = 0.0
    max_abs, differ, elements = 0.0, [], 0
    chunk: list[str] = []
    size = 0
    for i, k in enumerate(keys):
        md = want_md[k]
        chunk.append(k)
        size += math.prod(md.size) * md.properties.dtype.itemsize
        if size < chunk_bytes and i + 1 < len(keys):
            continue
        a, b = _read(got, meta_got, chunk), _read(want, meta_want, chunk)
        for name in chunk:
            x, y = a[name], b[name]
            elements += x.numel()
            if torch.equal(x, y):
                want_sq += float(y.double().square().sum())
                continue
            differ.append(name)
            d = x.double() - y.double()
            diff_sq += float(d.square().sum())
            want_sq += float(y.double().square().sum())
            max_abs = max(max_abs, float(d.abs().max()))
        chunk, size = [], 0
    rel = math.sqrt(diff_sq) / math.sqrt(want_sq) if want_sq > 0 else float(diff_sq > 0)
    return {"entries": len(keys), "elements": elements, "rel_l2": rel, "max_abs": max_abs,
            "entries_differ": len(differ), "first_differ": differ[:3], "exact": not differ and not problems,
            "problems": problems}


def param_band(references: dict[Side | int, Run], rerun: Run | None, settings: Settings) -> dict[str, Any]:
    """The parameter tolerances, measured as ``bands.order_band`` measures the loss's.

    * same layout (N->N): LOSS_K x the deviation of a same-layout rerun from
      its reference (0 where runs are deterministic, as on CPU: the resume
      must then give the very bits).
    * another layout: LOSS_K x the larger of that and the largest deviation
      between the references at the pair sides' layouts, which read the same
      batches and differ only by the reduction order, over all S+K steps (an
      upper bound for a resume, whose runs differ over the first S only).

    Per figure (``FIGURES``). No floor: the figures are read from the
    checkpoints in full precision (the loss has a floor because its log
    has 5 decimals), so runs that agree bit for bit demand bits.
    """
    refs = {as_side(k): v for k, v in references.items()}
    rerun_dev = {f: 0.0 for f in FIGURES}
    if rerun is not None:
        dev = param_deviation(final_checkpoint(rerun, settings), final_checkpoint(refs[rerun.side], settings))
        rerun_dev = {f: dev[f] for f in FIGURES}
    order_dev = {f: 0.0 for f in FIGURES}
    between: dict[str, list[Any]] = {f: [] for f in FIGURES}
    sides = sorted(refs, key=Side.sort_key)
    for i, a in enumerate(sides):
        for b in sides[i + 1:]:
            dev = param_deviation(final_checkpoint(refs[a], settings), final_checkpoint(refs[b], settings))
            for f in FIGURES:
                if dev[f] >= order_dev[f]:
                    order_dev[f], between[f] = dev[f], [a.key, b.key]
    return {"rerun_size": rerun.side.key if rerun is not None else None, "rerun_deviation": rerun_dev,
            "reduction_order_deviation": order_dev, "reduction_order_between": between,
            "band_same_size": {f: LOSS_K * rerun_dev[f] for f in FIGURES},
            "band": {f: LOSS_K * max(rerun_dev[f], order_dev[f]) for f in FIGURES},
            "references": [s.key for s in sides], "step": settings.total_steps}


def pair_param_band(source: Side | int, target: Side | int, band: dict[str, Any]) -> dict[str, float]:
    """One pair's tolerances from ``param_band``: the rerun's for a resume
    at its own layout, the reduction-order band otherwise."""
    return band["band_same_size"] if as_side(source) == as_side(target) else band["band"]


def param_problems(pair: str, target: Side, dev: dict[str, Any], tolerance: dict[str, float], step: int) -> list[str]:
    """The failure lines of one pair's parameter comparison (none when within tolerance)."""
    out = [f"{pair}: parameters at step {step}: {p}" for p in dev["problems"]]
    what = {"rel_l2": "relative L2", "max_abs": "max |diff|"}
    for f in FIGURES:
        if not dev[f] <= tolerance[f]:
            out.append(f"{pair}: parameters at step {step} differ from the uninterrupted run at "
                       f"{target.ranks()} beyond the reduction order: {what[f]} {dev[f]:.3g} > {tolerance[f]:.3g} "
                       f"({dev['entries_differ']} of {dev['entries']} entries differ, e.g. "
                       f"{', '.join(dev['first_differ'])})")
    return out
