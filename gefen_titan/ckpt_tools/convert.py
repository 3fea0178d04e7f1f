"""``gefen-titan ckpt convert``: Gefen state to AdamW moments, and back.

Gefen's update is Adam's with a quantized first moment and a block second
moment (docs/gefen_internals.md b): per block of ``period`` elements,
``m = codebook[code] * magnitude``, ``h = sqrt(vmean) / sqrt(1 - beta2**vmean_step)
+ eps``, ``p -= lr * m / (1 - beta1**step) / h``, with AdamW's decoupled weight
decay. So the state maps onto torch's AdamW one to one:

* ``--to adamw`` (formats v2, v3 and v4): ``exp_avg`` = the dequantized momentum
  (``optim.quant.requant.dequantize``, Gefen's own arithmetic), ``exp_avg_sq`` =
  each block's ``vmean`` broadcast over its elements (a factored parameter's:
  its rebuilt second moment ``outer(vrow, vcol) / mean(vrow)`` per matrix,
  what its step divides by), ``step`` = Gefen's
  ``step``; the hyperparameters of each record become the AdamW param group.
  AdamW's next step from this state is Gefen's next step except that it
  keeps the new momentum unquantized and the new second moment per element.
* ``--to gefen``: the periods are chosen by agreed blocking's rule
  (``blocking``: candidates = divisors of the row unit, which respects the
  last-dim cuts of ``--max-tensor-parallel-degree``; Gefen's scoring and
  fallback), scored on ``exp_avg_sq`` where Gefen scores the first step's
  grad² (the second moment is the running mean of grad², and it is the
  quantity Gefen then averages per block); one codebook is solved
  (``codebook_solver``) from the 4096-bin histogram of block-normalized
  ``exp_avg``, the values the codes will hold; the momentum is quantized
  with Gefen's rule (``optim.quant.requant.requantize``) and ``vmean`` is the
  block mean of ``exp_avg_sq`` (``optim.quant.requant.block_mean``) for a
  vector; ``step`` = ``vmean_step`` = AdamW's ``step``. A parameter of two
  dims or more keeps the row and column means of ``exp_avg_sq`` (``vrow``,
  ``vcol``: the factored second moment of ``optim.kinds.gefen.factored``,
  exact when ``exp_avg_sq`` is rank one), as the recipes' default
  ``optimizer.gefen.second_moment`` resumes it; ``--second-moment block``
  writes block means instead, to resume with ``second_moment = "block"``.
  The report gives the relative error of both moments.

The state of any other kind whose description says why it cannot be
converted (``checkpoint.format.kinds.KindDescription.convert_refusal``: GefenMuon's
momentum is Muon's, orthogonalized by Newton-Schulz, with NorMuon's per-row
second moment, which AdamW's moments cannot hold) is refused, before
anything is written. This module is Gefen's own: its arithmetic is Gefen's.

Every other entry (model, data loader, LR scheduler, train state, other
optimizers' state) is copied unchanged, so ``train.py`` resumes the result
as it resumes its own checkpoints. The new checkpoint is written to a
temporary folder next to ``OUT`` and renamed into place (local folders), so
a failed conversion leaves nothing behind; ``OUT`` must not exist. Memory:
the source's non-optimizer entries and the converted state are held in
memory (about the output checkpoint's size), one parameter's source moments
at a time.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import OPTIMIZER
from torchtitan.tools import filesystem

from gefen_titan.checkpoint.errors import CONVERT_TARGETS, root_cause
from gefen_titan.checkpoint.format import digests, kinds, schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.convert_options import ConvertOptions
from gefen_titan.ckpt_tools.convert_to_gefen import to_gefen
from gefen_titan.ckpt_tools.saved_records import read_records
from gefen_titan.ckpt_tools.view import Checkpoint, CkptError, split_state_key
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen.factored import rebuilt
from gefen_titan.optim.quant.requant import dequantize, expand_blocks

__all__ = ["ConvertOptions", "convert", "render"]

_DEFAULTS = ConvertOptions()


def convert(path: str, out: str, to: str, options: ConvertOptions = _DEFAULTS) -> dict[str, Any]:
    """Convert the checkpoint at ``path`` into a new one at ``out``; the report."""
    if to not in CONVERT_TARGETS:
        raise CkptError(f"--to {to!r}: expected {' or '.join(CONVERT_TARGETS)}")
    ck = Checkpoint(path)
    _refuse_kinds(ck)
    _check_out(ck.path, out)
    if to == "adamw":
        entries, report, replaced = _to_adamw(ck, options)
    else:
        entries, report, replaced = to_gefen(ck, options)
    copied = [k for k in ck.entries if k not in replaced]
    state = _nested(ck, copied)
    for name, value in entries.items():
        state.setdefault(OPTIMIZER, {})[name] = value
    _write(state, out)
    report.update(source=ck.path, out=str(out), to=to, copied_entries=len(copied))
    return report


# ------------------------------------------------------------------ I/O
def _check_out(source: str, out: str) -> None:
    out = str(out)
    same = (out.rstrip("/") == source.rstrip("/") if storage.is_remote(out) else
            os.path.abspath(out) == os.path.abspath(source))
    if same:
        raise CkptError("OUT is the source checkpoint: write the converted checkpoint to a new folder")
    if filesystem.exists(out):
        raise CkptError(f"{out} exists: give a new folder (convert never overwrites a checkpoint)")


def _refuse_kinds(ck: Checkpoint) -> None:
    """Refuse, before anything is written, a checkpoint holding state of a kind whose description says
    convert cannot convert it (``KindDescription.convert_refusal``)."""
    saved = read_records(ck)
    for desc in kinds.descriptions():
        records = saved.kinds.get(desc.name) if saved is not None else None
        if desc.convert_refusal is None or records is None or not (records.optimizers or records.codebooks):
            continue
        fqns = [p.fqn for p in records.params]
        raise CkptError(
            f"convert handles Gefen <-> AdamW; {ck.path} holds {desc.name} state for {len(fqns)} parameters ("
            + ", ".join(fqns[:3]) + (" ..." if len(fqns) > 3 else "") + f"): {desc.convert_refusal}. Nothing was "
            "written")


def _nested(ck: Checkpoint, keys: list[str]) -> dict[str, Any]:
    """The entries as the saved state dict nested them (the planner data), values read in full."""
    values = ck.load(keys)
    state: dict[str, Any] = {}
    for key in keys:
        path = ck.entries[key].path
        if not all(isinstance(p, str) for p in path):
            raise CkptError(f"{key}: a nested list entry {path} cannot be copied by this tool")
        d = state
        for part in path[:-1]:
            d = d.setdefault(part, {})
        d[path[-1]] = values[key]
    return state


def _write(state: dict[str, Any], out: str) -> None:
    out = str(out).rstrip("/")
    target = out if storage.is_remote(out) else f"{out}.partial-{os.getpid()}"
    try:
        if not storage.is_remote(out):
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(state, storage_writer=storage.storage_writer(target, key=digests.current_key()),
                     no_dist=True)  # signed with the key the source was read with (cli: --digest-key-env)
        if target != out:
            os.replace(target, out)
    except Exception as e:
        if target != out:
            shutil.rmtree(target, ignore_errors=True)
        raise CkptError(f"cannot write {out} ({root_cause(e)}); nothing was written") from e


# ------------------------------------------------------------------ Gefen -> AdamW
def _adamw_group(group: dict[str, float], implementation: str) -> dict[str, Any]:
    """A torch AdamW param group with Gefen's hyperparameters, keyed as torch writes it."""
    impl = {"fused": implementation == "fused", "foreach": implementation == "foreach"}
    dummy = torch.optim.AdamW([torch.zeros(1)], lr=group["lr"], betas=(group["beta1"], group["beta2"]),
                              eps=group["eps"], weight_decay=group["weight_decay"], **impl)
    out = {k: v for k, v in dummy.param_groups[0].items() if k != "params"}
    # torchtitan's LR scheduler adds initial_lr to every group (and recomputes
    # lr from the recipe on resume); a loading run asks for the key.
    out["initial_lr"] = group["lr"]
    return out


def _to_adamw(ck: Checkpoint, options: ConvertOptions):
    saved = read_records(ck)
    gefen = saved.kinds.get("Gefen") if saved is not None else None
    if gefen is None or not gefen.optimizers:
        kinds_ = sorted({split_state_key(n)[1] for n in ck.optimizer if split_state_key(n)})
        raise CkptError(f"{ck.path} holds no Gefen state" + (f" (its optimizer state is {', '.join(kinds_)})"
                                                               if kinds_ else " (no optimizer state at all)")
                        + ": nothing to convert to AdamW")
    if saved.version not in schema.AGREED_VERSIONS:
        raise CkptError(f"{ck.path} is Gefen format v{saved.version} (per-rank blocking): convert reads formats "
                        f"v{schema.V2} to v{schema.VERSION} (agreed blocking) only. Resume it with "
                        "optimizer.blocking.mode = \"per_rank\" instead, or convert a checkpoint of an "
                        "agreed-blocking run")
    if saved.problems:
        name, what = saved.problems[0]
        raise CkptError(f"{ck.path}: the Gefen records are inconsistent ({name}: {what}); run "
                        "`gefen-titan ckpt verify` on it. Nothing was written")
    codebook = next(iter(gefen.codebooks.values()), None)
    opt = ck.optimizer
    entries: dict[str, Any] = {}
    steps, notes = Counter(), []
    for p in gefen.params:
        numel = math.prod(p.shape)
        if p.period:
            keys = gefen_keys.param_tensor_keys(p.fqn, saved.version, p.factored)
            vals = ck.load_names(OPTIMIZER, list(keys.values()))
            tensors = {name: vals[key] for name, key in keys.items()}
            codes = tensors["codes"].reshape(-1)
            mag, vmean = gefen_keys.unpack_blocks(saved.version, tensors)
            checked = {"magnitude": mag, "vmean": vmean, "vrow": tensors.get("vrow"), "vcol": tensors.get("vcol")}
            for what, t in checked.items():  # the load's check of them, before any write
                why = None if t is None else kinds.nonnegative_problem(t)
                if why:
                    raise CkptError(f"{p.fqn}: non-finite or negative {what} in {ck.path} ({why}): the resume "
                                    f"refuses it too; `gefen-titan ckpt verify {ck.path}` lists what is wrong. "
                                    "Nothing was written")
            exp_avg = dequantize(codes, codebook, mag.reshape(-1), p.period).view(p.shape)
            if p.factored:
                exp_avg_sq = rebuilt(tensors["vrow"], tensors["vcol"], p.shape)
            else:
                exp_avg_sq = expand_blocks(vmean.reshape(-1), p.period, 0, numel).reshape(p.shape).clone()
        else:  # no state yet (saved before its first step): AdamW's fresh state
            exp_avg, exp_avg_sq = torch.zeros(p.shape), torch.zeros(p.shape)
        if p.vmean_step != p.step:
            notes.append(f"{p.fqn}: vmean_step {p.vmean_step} != step {p.step}; AdamW has one counter (step)")
        steps[p.step] += 1
        entries[f"state.{p.fqn}.exp_avg"] = exp_avg
        entries[f"state.{p.fqn}.exp_avg_sq"] = exp_avg_sq
        entries[f"state.{p.fqn}.step"] = torch.tensor(float(p.step))
        for k, v in _adamw_group(p.group, options.implementation).items():
            entries[f"param_groups.{p.fqn}.{k}"] = v
    replaced = {e.key for n, e in opt.items() if schema.is_gefen_key(n)}
    report = {
        "params": len(gefen.params),
        "elements": sum(math.prod(p.shape) for p in gefen.params),
        "steps": {str(k): v for k, v in sorted(steps.items())},
        "written": "state.{fqn}.exp_avg / exp_avg_sq / step, param_groups.{fqn}.* (AdamW)",
        "notes": notes,
        "resume": "--optimizer.name AdamW",
    }
    return entries, report, replaced


# ------------------------------------------------------------------ text
def render(report: dict[str, Any]) -> str:
    lines = [f"converted {report['source']}", f"     into {report['out']}: {report['written']}",
             f"          {report['params']} parameters ({report['elements']:,} elements), steps "
             + ", ".join(f"{k} ({v})" for k, v in report["steps"].items())
             + f"; {report['copied_entries']} other entries copied unchanged"]
    if report["to"] == "gefen":
        lines.append("          periods " + ", ".join(f"{k} ({v})" for k, v in report["periods"].items())
                     + (f"; {report['state_bytes_per_param']:.3f} bytes/param of state"
                        if report["state_bytes_per_param"] else ""))
        lines.append(f"          relative RMS error: momentum {report['momentum_relative_rms_error']:.4f}, "
                     f"second moment {report['second_moment_relative_rms_error']:.4f} "
                     f"({'row and column means' if report['second_moment'] == 'factored' else 'block mean'})")
    lines.append(f"resume:   train.py with {report['resume']}, this folder as "
                 "<dump_folder>/<checkpoint.folder>/step-N")
    lines += [f"note:     {n}" for n in report["notes"][:5]]
    return "\n".join(lines)
