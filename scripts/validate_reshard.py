#!/usr/bin/env python
"""End-to-end reshard validation: save at N data-parallel ranks, resume at M.

    python scripts/validate_reshard.py --recipe recipes/llama_gefen.toml --from 2 --to 4
    python scripts/validate_reshard.py --pairs 2:4,4:2,2:1

For every pair N:M, with S = --steps-before and K = --steps-after:

1. reference: an uninterrupted run at N ranks for S+K steps that checkpoints
   at step S (``training.steps = S+K`` in every run, so the LR schedule is the
   same). Its step-S checkpoint is exactly what an interrupted run saves.
   There is one reference per size that appears in the pairs (targets too:
   they measure the loss band), shared by all pairs.
2. resume: the step-S checkpoint copied into the pair's own folder, loaded by
   ``torchrun --nproc_per_node M train.py`` (same recipe,
   ``--checkpoint.load_step S``), trained K more steps.
3. compare:
   * the state right after the load against the reference's state at the
     save (``gefen_titan.validate_hooks`` dumps both; it is switched on per
     run through torchtitan's ``--override.imports``): parameters bit-exact;
     Gefen momentum and second moment bit-exact wherever the adapter promises
     it (a target shard on whole blocks of one source rank, with that rank's
     codebook adopted), otherwise within the adapter's error bounds; step
     counters equal; other optimizers' state (AdamW groups) bit-exact;
   * the first update the loaded state gives against the reference state's
     (the Adam-style direction m / (sqrt(v) + eps) for a zero new gradient:
     the state's whole share of the next step's error);
   * the loss of steps S+1..S+K against the reference, within a band
     measured on the reference runs (the resumed run reads other documents:
     the elastic loader hands the unread documents to M ranks, so the losses
     cannot be equal; ``loss_band``); N->N resumes must match exactly.
4. prints a table (pair, loss deviation and band, state and first-update
   errors, checkpoint bytes, save/load seconds), writes ``report.json`` and a
   PNG of the loss curves (one panel per pair), and exits 1 naming each pair
   and figure that broke its tolerance.

The global batch is held fixed (``training.global_batch_size``, default 16;
torchtitan turns the per-rank ``local_batch_size`` into gradient
accumulation), so the curves at different DP sizes are comparable.

Backend: NCCL with one GPU per rank when ``torch.cuda.device_count()`` is at
least the largest rank count, else gloo on CPU (``CUDA_VISIBLE_DEVICES`` is
emptied for the runs); ``--backend`` forces one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOOK = "gefen_titan.validate_hooks.dump_state"
STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([0-9.eE+-]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")

# ---------------------------------------------------------------- tolerances
# State after load, where the adapter does not promise bit-exactness: the
# adapter's own bounds (tests/test_reshard.py): one requantization of the
# momentum against a merged codebook, block means of vmean.
TOL_MOMENTUM = 2e-2  # relative L2 of the dequantized momentum
TOL_VMEAN = 5e-2  # relative L2 of the per-element second moment
TOL_UPDATE = 3e-2  # relative L2 of the first update direction
# Loss: |resumed - reference| <= max(LOSS_FLOOR, LOSS_K * sigma), sigma the
# batch-to-batch noise of the loss measured on the reference curve(s); see
# loss_band() and docs/validation.md for the measurement.
LOSS_K = 3.0
LOSS_FLOOR = 0.02

# The settings CI uses (tests/test_validate_reshard.py and the stored recipe
# curves, scripts/update_reference_curves.py): small, so a run is seconds of
# compute. Runs with equal settings share one reference (--reference-cache).
CI_SETTINGS = {"steps_before": 4, "steps_after": 3, "global_batch": 8, "local_batch": 2}


# ------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_losses(log: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for step, loss in STEP_RE.findall(ANSI_RE.sub("", log)):
        out.setdefault(int(step), float(loss))
    return out


def toml_value(value: Any) -> str:
    """A CLI override value the recipe loader reads back as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass
class Settings:
    recipe: str
    steps_before: int = 4
    steps_after: int = 3
    global_batch: int | None = 16
    local_batch: int | None = None
    extra: list[str] = field(default_factory=list)  # more "--section.key value" overrides
    backend: str = "gloo"

    @property
    def total_steps(self) -> int:
        return self.steps_before + self.steps_after

    def overrides(self, nproc: int) -> list[str]:
        """Overrides every run gets (reference and resume alike)."""
        args = [
            "--training.steps", str(self.total_steps),
            "--parallelism.data_parallel_shard_degree", str(nproc),
            "--checkpoint.enable", "true",
            "--checkpoint.interval", str(self.steps_before),
            "--checkpoint.keep_latest_k", "0",
            "--checkpoint.last_save_model_only", "true",  # the end state is not compared
            "--metrics.log_freq", "1",
        ]
        if self.global_batch:
            args += ["--training.global_batch_size", str(self.global_batch)]
        if self.local_batch:
            args += ["--training.local_batch_size", str(self.local_batch)]
        return args + list(self.extra)


def resolve_recipe(recipe: str) -> str:
    """An absolute recipe path: as given if it exists from here, else from the repository root."""
    path = Path(recipe)
    if not path.is_absolute() and not path.exists():
        path = ROOT / recipe
    return str(path.resolve())


def run_identity(recipe: str, nproc: int, overrides: list[str]) -> str:
    """What a run computes: the merged recipe tables plus overrides, with the
    fields that do not change training (description, dump folder) left out.

    Two recipes that resolve to the same tables (``llama_gefen.toml`` at 2
    ranks and ``llama_gefen_dp2.toml``) are the same run.
    """
    from gefen_titan.recipe import _merge, _read_recipe_data, parse_cli

    recipe = resolve_recipe(recipe)
    data = _read_recipe_data(recipe)
    _, ov = parse_cli(["--job.config", recipe, *overrides])
    _merge(data, ov, recipe)
    job = data.get("job", {})
    for key in ("description", "dump_folder", "extends"):
        job.pop(key, None)
    par = data.setdefault("parallelism", {})
    if par.get("data_parallel_shard_degree", -1) == -1:
        par["data_parallel_shard_degree"] = nproc
    blob = json.dumps({"nproc": nproc, "tables": data}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def recipe_imports(recipe: str) -> list[Any]:
    from gefen_titan.recipe import load_recipe

    overrides = {"parallelism": {"data_parallel_shard_degree": -1}}  # any mesh: only [override] is read
    imports = load_recipe(resolve_recipe(recipe), overrides, world_size=1).config.override.imports
    return [e if isinstance(e, str) else [e[0], dict(e[1])] for e in imports]


@dataclass
class Run:
    """One torchrun launch: its folder, log, loss curve and dumps."""

    folder: str
    nproc: int
    losses: dict[int, float]
    seconds: float
    identity: str = ""

    def dumps(self, kind: str, step: int) -> list[dict]:
        import torch

        files = sorted(Path(self.folder, "validate").glob(f"{kind}-{step}-rank*.pt"),
                       key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
        return [torch.load(f, weights_only=True) for f in files]


def launch(settings: Settings, nproc: int, folder: Path, extra: list[str], *, save_steps: list[int],
           env: dict[str, str], quiet: bool = False) -> Run:
    """``torchrun --nproc_per_node nproc train.py`` with the dump hook on."""
    folder.mkdir(parents=True, exist_ok=True)
    hook = [HOOK, {"dir": str(folder / "validate"), "save_steps": save_steps}]
    imports = recipe_imports(settings.recipe) + [hook]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master-port={free_port()}", str(ROOT / "train.py"),
        "--job.config", resolve_recipe(settings.recipe), "--job.dump_folder", str(folder),
        *settings.overrides(nproc), *extra,
        "--override.imports", toml_value(imports),
    ]
    if not quiet:
        print(f"  $ torchrun --nproc_per_node={nproc} train.py ... --job.dump_folder {folder} {' '.join(extra)}", flush=True)
    begin = time.monotonic()
    with open(folder / "train.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.monotonic() - begin
    text = (folder / "train.log").read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"run in {folder} failed (exit {proc.returncode}); last lines of {folder / 'train.log'}:\n"
                           + "\n".join(text.splitlines()[-40:]))
    run = Run(str(folder), nproc, parse_losses(text), seconds)
    (folder / "run.json").write_text(json.dumps({**asdict(run), "cmd": cmd}, indent=1))
    return run


def run_env(backend: str) -> dict[str, str]:
    env = dict(os.environ)
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even where GPUs are visible
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def reference_run(settings: Settings, nproc: int, *, out: Path, cache: Path | None = None, quiet: bool = False) -> Run:
    """The uninterrupted S+K-step run at ``nproc`` ranks, dumped at step S.

    With ``cache``, a run of the same identity already there is reused (and a
    new one is kept there for the next caller).
    """
    overrides = settings.overrides(nproc)
    identity = run_identity(settings.recipe, nproc, overrides)
    folder = (cache / f"ref-{nproc}-{identity}") if cache else (out / f"ref-{nproc}")
    done = folder / "run.json"
    if cache and done.exists():
        run = Run(**{k: v for k, v in json.loads(done.read_text()).items() if k in Run.__dataclass_fields__})
        run.losses = {int(k): v for k, v in run.losses.items()}
        if not quiet:
            print(f"  reference at {nproc} rank(s): reusing {folder}", flush=True)
        return run
    if folder.exists():
        shutil.rmtree(folder)
    if not quiet:
        print(f"  reference at {nproc} rank(s), {settings.total_steps} steps, checkpoint at {settings.steps_before}", flush=True)
    run = launch(settings, nproc, folder, [], save_steps=[settings.steps_before], env=run_env(settings.backend), quiet=quiet)
    run.identity = identity
    data = json.loads(done.read_text())
    data["identity"] = identity
    done.write_text(json.dumps(data, indent=1))
    return run


def resume_run(settings: Settings, ref: Run, nproc: int, folder: Path, fault: str | None = None) -> Run:
    if folder.exists():
        shutil.rmtree(folder)
    step = settings.steps_before
    src = Path(ref.folder, "checkpoint", f"step-{step}")
    if not src.is_dir():
        raise RuntimeError(f"reference {ref.folder} has no step-{step} checkpoint")
    shutil.copytree(src, folder / "checkpoint" / f"step-{step}")
    extra = ["--checkpoint.load_step", str(step)]
    if fault == "drop-optimizer":
        extra += ["--checkpoint.exclude_from_loading", "optimizer"]
    print(f"  resume {ref.nproc} -> {nproc} rank(s) from step {step}, {settings.steps_after} more steps"
          + (f" [fault injected: {fault}]" if fault else ""), flush=True)
    return launch(settings, nproc, folder, extra, save_steps=[], env=run_env(settings.backend))


# ------------------------------------------------------------ state analysis
def _flat(dumps: list[dict], key: str, fqn: str) -> tuple[Any, list[tuple[int, int]]]:
    import torch

    recs = [d[key][fqn] for d in dumps if fqn in d[key]]
    numel = math.prod(recs[0]["shape"])
    full = torch.zeros(numel)
    for rec in recs:
        if rec["length"]:
            full[rec["start"]:rec["start"] + rec["length"]] = rec["local"]
    return full, [(r["start"], r["length"]) for r in recs]


def dense_gefen(dumps: list[dict]) -> dict[str, dict]:
    """Per Gefen parameter: dense momentum m and per-element vmean v over the
    whole parameter, the counters, and each rank's (start, length, period)."""
    import torch

    out: dict[str, dict] = {}
    for rank, d in enumerate(dumps):
        for fqn, rec in d["gefen"].items():
            numel = math.prod(rec["shape"])
            e = out.setdefault(fqn, {"m": torch.zeros(numel), "v": torch.zeros(numel), "missing": 0,
                                     "steps": set(), "vsteps": set(), "regions": [], "hyper": rec["hyper"],
                                     "global_steps": set(), "lrs": set()})
            if not rec["length"]:
                continue
            e["lrs"].add(rec["hyper"]["lr"])
            if "codes" not in rec:
                e["missing"] += rec["length"]
                e["regions"].append((rank, rec["start"], rec["length"], 0, rec["optimizer"]))
                continue
            cb = d["codebooks"][rec["optimizer"]]["codebook"]
            p = rec["period"]
            sl = slice(rec["start"], rec["start"] + rec["length"])
            # Gefen's own dequantization: codebook.index_select(codes) * magnitude.
            e["m"][sl] = cb.index_select(0, rec["codes"].long()) * rec["magnitude"].repeat_interleave(p)
            e["v"][sl] = rec["vmean"].repeat_interleave(p)
            e["steps"].add(rec["step"])
            e["vsteps"].add(rec["vmean_step"])
            e["global_steps"].add(d["codebooks"][rec["optimizer"]]["global_step"])
            e["regions"].append((rank, rec["start"], rec["length"], p, rec["optimizer"]))
    return out


def _promised_exact(ref: dict[str, dict], res: dict[str, dict], res_dumps: list[dict]) -> dict[str, list[slice]]:
    """Element ranges where the adapter promises a bit-exact state.

    A target rank adopts a source rank's codebook when all of its elements
    of that optimizer come from that one source; then each of its shards that
    lies on whole blocks of that source keeps codes, magnitudes and vmean.
    """
    promised: dict[str, list[slice]] = {}
    for rank in range(len(res_dumps)):
        by_opt: dict[str, set] = {}
        mine = []
        for fqn, e in res.items():
            for r, start, length, _, opt in e["regions"]:
                if r != rank or not length:
                    continue
                srcs = [s for s in ref[fqn]["regions"] if s[3] and s[1] < start + length and start < s[1] + s[2]]
                by_opt.setdefault(opt, set()).update(s[0] for s in srcs)
                mine.append((fqn, start, length, opt, srcs))
        for fqn, start, length, opt, srcs in mine:
            if len(by_opt[opt]) != 1 or len(srcs) != 1:
                continue
            _, s_start, s_len, period, _ = srcs[0]
            if s_start <= start and start + length <= s_start + s_len and (start - s_start) % period == 0 \
                    and (start + length - s_start) % period == 0:
                promised.setdefault(fqn, []).append(slice(start, start + length))
    return promised


def _rel(a, b) -> float:
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm() > 0)


def compare_state(ref_dumps: list[dict], res_dumps: list[dict]) -> dict[str, Any]:
    """The resumed run's state right after the load against the reference's
    state at the save."""
    import torch

    problems: list[str] = []
    # Parameters: DCP reshards them element-wise, so bit-exact.
    param_mismatch = []
    for fqn in ref_dumps[0]["params"]:
        a, _ = _flat(ref_dumps, "params", fqn)
        b, _ = _flat(res_dumps, "params", fqn)
        if not torch.equal(a, b):
            param_mismatch.append(fqn)
    if param_mismatch:
        problems.append(f"parameters differ after load ({len(param_mismatch)}: {', '.join(param_mismatch[:3])})")

    ref, res = dense_gefen(ref_dumps), dense_gefen(res_dumps)
    if set(ref) != set(res):
        problems.append("the Gefen parameter sets differ")
    promised = _promised_exact(ref, res, res_dumps)
    num = {"m": 0.0, "v": 0.0, "u": 0.0}
    den = {"m": 0.0, "v": 0.0, "u": 0.0}
    worst_update, exact_elems, exact_broken, total, missing = 0.0, 0, [], 0, 0
    counters: list[str] = []
    lrs: list[str] = []
    for fqn, r in ref.items():
        s = res.get(fqn)
        if s is None:
            continue
        total += r["m"].numel()
        missing += s["missing"]
        if s["steps"] != r["steps"] or s["vsteps"] != r["vsteps"] or s["global_steps"] != r["global_steps"]:
            counters.append(f"{fqn}: {sorted(s['steps'])}/{sorted(s['vsteps'])}/{sorted(s['global_steps'])} "
                            f"!= saved {sorted(r['steps'])}/{sorted(r['vsteps'])}/{sorted(r['global_steps'])}")
        if s["lrs"] != r["lrs"]:
            lrs.append(f"{fqn}: {sorted(s['lrs'])} != saved {sorted(r['lrs'])}")
        for sl in promised.get(fqn, []):
            exact_elems += sl.stop - sl.start
            if not (torch.equal(s["m"][sl], r["m"][sl]) and torch.equal(s["v"][sl], r["v"][sl])):
                exact_broken.append(fqn)
        # First update for a zero new gradient: m' = b1 m, v' = b2 v, one more
        # step for the bias correction; the constant 1/bc1 cancels.
        h = r["hyper"]
        vstep = max(r["vsteps"] or {0}) + 1
        bc2 = 1 - h["beta2"] ** vstep
        u_ref = r["m"] / ((h["beta2"] * r["v"] / bc2).sqrt() + h["eps"])
        u_res = s["m"] / ((h["beta2"] * s["v"] / bc2).clamp_min(0).sqrt() + h["eps"])
        for key, (a, b) in {"m": (s["m"], r["m"]), "v": (s["v"], r["v"]), "u": (u_res, u_ref)}.items():
            num[key] += float((a - b).double().square().sum())
            den[key] += float(b.double().square().sum())
        worst_update = max(worst_update, _rel(u_res, u_ref))
    if missing:
        problems.append(f"{missing} of {total} Gefen elements have no optimizer state after the load")
    if counters:
        problems.append(f"step counters (step/vmean_step/global_step) differ after the load for {len(counters)} "
                        f"of {len(ref)} Gefen parameters, e.g. {counters[0]}")
    if lrs:
        problems.append(f"learning rate differs after the load for {len(lrs)} of {len(ref)} Gefen parameters, e.g. {lrs[0]}")
    if exact_broken:
        problems.append(f"state not bit-exact where the adapter promises it ({', '.join(sorted(set(exact_broken))[:3])})")

    # Other optimizers (AdamW groups): torch state, resharded element-wise.
    other_mismatch = []
    for fqn, rec in ref_dumps[0]["other_optim"].items():
        for key, value in rec.items():
            if key in ("shape", "start", "length"):
                continue
            if isinstance(value, float):
                same = all(d["other_optim"].get(fqn, {}).get(key) == value for d in res_dumps)
            else:
                full_ref = _flat_key(ref_dumps, fqn, key)
                full_res = _flat_key(res_dumps, fqn, key)
                same = full_res is not None and torch.equal(full_ref, full_res)
            if not same:
                other_mismatch.append(f"{fqn}.{key}")
    if other_mismatch:
        problems.append(f"non-Gefen optimizer state differs after load ({', '.join(other_mismatch[:3])})")

    rel = {k: math.sqrt(num[k] / den[k]) if den[k] > 0 else 0.0 for k in num}
    return {
        "params_exact": not param_mismatch,
        "momentum_rel_l2": rel["m"],
        "vmean_rel_l2": rel["v"],
        "first_update_rel_l2": rel["u"],
        "first_update_worst_param": worst_update,
        "exact_promised_fraction": exact_elems / total if total else 0.0,
        "exact_held": not exact_broken,
        "gefen_elements": total,
        "problems": problems,
    }


def _flat_key(dumps: list[dict], fqn: str, key: str):
    import torch

    recs = [d["other_optim"][fqn] for d in dumps if fqn in d["other_optim"]]
    if not recs or any(key not in r for r in recs if r["length"]):
        return None
    full = torch.zeros(math.prod(recs[0]["shape"]))
    for r in recs:
        if r["length"]:
            full[r["start"]:r["start"] + r["length"]] = r[key]
    return full


def checkpoint_bytes(step_dir: Path) -> dict[str, Any]:
    """Bytes on disk of the step-S checkpoint, and the optimizer's share of
    them (the stored lengths of the ``optimizer.`` items, from DCP's metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata()
    opt = sum(info.length for index, info in meta.storage_data.items() if index.fqn.startswith("optimizer."))
    return {"total": dir_bytes(step_dir), "optimizer": opt}


# ---------------------------------------------------------------- loss band
def _second_differences(losses: dict[int, float], first: int, last: int | None) -> list[float]:
    steps = sorted(s for s in losses if s >= first and (last is None or s <= last))
    return [losses[a] - 2 * losses[b] + losses[c] for a, b, c in zip(steps, steps[1:], steps[2:]) if c - a == 2]


def second_difference_noise(losses: dict[int, float], first: int = 2, last: int | None = None) -> float:
    """Noise of the difference of two runs' losses at one step, from one curve.

    For a curve L[t] = trend + e[t] with independent batch noise e of std
    sigma, the second differences L[t-1] - 2 L[t] + L[t+1] have variance
    6 sigma^2, and two runs that read different batches differ by
    sqrt(2) sigma; so this returns RMS(second differences) / sqrt(3). The
    trend's curvature adds to it. Step 1 (before any update) is left out;
    ``first``/``last`` bound the steps used.
    """
    d2 = _second_differences(losses, first, last)
    return math.sqrt(sum(x * x for x in d2) / len(d2) / 3) if d2 else 0.0


def loss_band(references: dict[int, Run], settings: Settings) -> dict[str, float]:
    """The loss tolerance of the pairs N->M with N != M, measured.

    The resumed run starts from the reference's exact state at step S but then
    reads other batches (the elastic loader splits the unread documents among
    M ranks), so it follows another trajectory: its loss differs from the
    reference's by what two runs that read the documents in another order
    differ by. The references at the pairs' sizes (target sizes included) are
    such runs: same recipe, seed, global batch and LR schedule, another
    document order. So sigma is
    (a) the RMS over steps S+1..S+K and over every two references of their
    loss difference, or, where larger (or with one reference only),
    (b) the second-difference noise (``second_difference_noise``) pooled over
    the references, on steps max(2, S-K)..S+K (earlier steps are the start-up
    transient, whose curvature is not noise);
    band = max(LOSS_FLOOR, LOSS_K * sigma).
    """
    first = max(2, settings.steps_before - settings.steps_after)
    d2 = [x for r in references.values() for x in _second_differences(r.losses, first, settings.total_steps)]
    noise = math.sqrt(sum(x * x for x in d2) / len(d2) / 3) if d2 else 0.0
    window = range(settings.steps_before + 1, settings.total_steps + 1)
    runs = list(references.values())
    diffs = [a.losses[t] - b.losses[t] for i, a in enumerate(runs) for b in runs[i + 1:]
             for t in window if t in a.losses and t in b.losses]
    between = math.sqrt(sum(d * d for d in diffs) / len(diffs)) if diffs else 0.0
    sigma = max(noise, between)
    return {"sigma_between_references": between, "sigma_second_difference": noise,
            "sigma": sigma, "band": max(LOSS_FLOOR, LOSS_K * sigma),
            "references": sorted(references)}


# ------------------------------------------------------------------- report
@dataclass
class PairResult:
    pair: str
    source: int
    target: int
    backend: str
    reference_losses: dict[int, float]
    resumed_losses: dict[int, float]
    loss_deviation: float
    loss_band: float
    state: dict[str, Any]
    checkpoint: dict[str, Any]
    save_seconds: float
    load_seconds: float
    failures: list[str]


def evaluate(settings: Settings, ref: Run, res: Run, band: float) -> PairResult:
    pair = f"{ref.nproc}->{res.nproc}"
    s = settings.steps_before
    window = range(s + 1, settings.total_steps + 1)
    failures = []
    missing_steps = [t for t in window if t not in res.losses or t not in ref.losses]
    if missing_steps:
        failures.append(f"{pair}: no loss logged for step(s) {missing_steps}")
    devs = [abs(res.losses[t] - ref.losses[t]) for t in window if t in res.losses and t in ref.losses]
    dev = max(devs) if devs else float("inf")
    if not all(math.isfinite(res.losses.get(t, float("nan"))) for t in window):
        failures.append(f"{pair}: non-finite loss after resume")
    if dev > band:
        failures.append(f"{pair}: max loss deviation {dev:.4f} > band {band:.4f}")

    ref_dumps, res_dumps = ref.dumps("save", s), res.dumps("load", s)
    if len(ref_dumps) != ref.nproc or len(res_dumps) != res.nproc:
        failures.append(f"{pair}: state dumps missing ({len(ref_dumps)}/{ref.nproc} saved, {len(res_dumps)}/{res.nproc} loaded)")
        state: dict[str, Any] = {"problems": ["no dumps"]}
    else:
        state = compare_state(ref_dumps, res_dumps)
        failures += [f"{pair}: {p}" for p in state["problems"]]
        for key, tol, what in (("momentum_rel_l2", TOL_MOMENTUM, "momentum error"),
                               ("vmean_rel_l2", TOL_VMEAN, "second-moment error"),
                               ("first_update_rel_l2", TOL_UPDATE, "first-update error")):
            if not state[key] <= tol:
                failures.append(f"{pair}: {what} {state[key]:.3g} > {tol:g}")
    ckpt = checkpoint_bytes(Path(ref.folder, "checkpoint", f"step-{s}"))
    save_s = max((d["seconds"] for d in ref_dumps), default=float("nan"))
    load_s = max((d["seconds"] for d in res_dumps), default=float("nan"))
    return PairResult(pair, ref.nproc, res.nproc, settings.backend, ref.losses, res.losses, dev, band,
                      state, ckpt, save_s, load_s, failures)


def table(results: list[PairResult], n_params: int | None) -> str:
    head = ("pair", "max|dloss|", "band", "momentum", "vmean", "1st update", "exact", "params",
            "ckpt MB", "opt B/param", "save s", "load s", "verdict")
    rows = [head]
    for r in results:
        st = r.state
        exact = f"{100 * st.get('exact_promised_fraction', 0):.0f}%" + ("" if st.get("exact_held", False) else " BROKEN")
        opt_bpp = r.checkpoint["optimizer"] / n_params if n_params else float("nan")
        rows.append((
            r.pair, f"{r.loss_deviation:.4f}", f"{r.loss_band:.4f}",
            f"{st.get('momentum_rel_l2', float('nan')):.2e}", f"{st.get('vmean_rel_l2', float('nan')):.2e}",
            f"{st.get('first_update_rel_l2', float('nan')):.2e}", exact,
            "exact" if st.get("params_exact") else "DIFFER",
            f"{r.checkpoint['total'] / 1e6:.1f}", f"{opt_bpp:.3f}",
            f"{r.save_seconds:.2f}", f"{r.load_seconds:.2f}", "FAIL" if r.failures else "ok",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: list[PairResult], settings: Settings, path: Path, references: dict[int, Run] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.0), squeeze=False, sharey=True)
    s = settings.steps_before
    for ax, r in zip(axes[0], results):
        ref = sorted(r.reference_losses.items())
        res = sorted(r.resumed_losses.items())
        other = (references or {}).get(r.target)
        if other is not None and r.target != r.source:
            pts = sorted(other.losses.items())
            ax.plot([t for t, _ in pts], [v for _, v in pts], "-", lw=1, color="grey", alpha=0.6,
                    label=f"uninterrupted at {r.target} ranks")
        ax.plot([t for t, _ in ref], [v for _, v in ref], "-o", ms=3, color="tab:blue", label=f"reference ({r.source} ranks)")
        win = [(t, v) for t, v in ref if t > s]
        if win:
            ax.fill_between([t for t, _ in win], [v - r.loss_band for _, v in win], [v + r.loss_band for _, v in win],
                            color="tab:blue", alpha=0.15, lw=0, label="tolerance band")
        ax.plot([t for t, _ in res], [v for _, v in res], "s--", ms=4, color="tab:red" if r.failures else "tab:orange",
                label=f"resumed ({r.target} ranks)")
        ax.axvline(s + 0.5, color="grey", lw=0.8, ls=":")
        ax.set_title(f"{r.pair}: |dloss| {r.loss_deviation:.3f}, 1st upd {r.state.get('first_update_rel_l2', float('nan')):.1e}"
                     + (" FAIL" if r.failures else ""), fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("loss", fontsize=8)
    fig.suptitle(f"{Path(settings.recipe).name}: save at step {s}, resume, {settings.steps_after} more steps "
                 f"({settings.backend})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_pairs(args) -> list[tuple[int, int]]:
    if args.pairs:
        pairs = []
        for item in args.pairs.split(","):
            a, _, b = item.strip().partition(":")
            pairs.append((int(a), int(b)))
        return pairs
    if args.source is None or args.target is None:
        raise SystemExit("give --from N --to M, or --pairs N:M,...")
    return [(args.source, args.target)]


def choose_backend(requested: str, max_ranks: int) -> tuple[str, str]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl":
        if gpus < max_ranks:
            raise SystemExit(f"--backend nccl needs {max_ranks} GPUs, {gpus} visible")
        return "nccl", f"NCCL, one GPU per rank ({gpus} visible)"
    if requested == "gloo" or gpus < max_ranks:
        why = "forced" if requested == "gloo" else f"{gpus} GPU(s) visible, {max_ranks} needed for NCCL"
        return "gloo", f"gloo on CPU ({why})"
    return "nccl", f"NCCL, one GPU per rank ({gpus} visible)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/llama_gefen.toml")
    ap.add_argument("--from", dest="source", type=int)
    ap.add_argument("--to", dest="target", type=int)
    ap.add_argument("--pairs", help="comma-separated N:M pairs, e.g. 2:4,4:2,2:1")
    ap.add_argument("--steps-before", type=int, default=4, help="S: checkpoint step (default 4)")
    ap.add_argument("--steps-after", type=int, default=3, help="K: steps after the resume (default 3)")
    ap.add_argument("--global-batch", type=int, default=16, help="training.global_batch_size for every run (0: the recipe's)")
    ap.add_argument("--local-batch", type=int, help="training.local_batch_size (default: the recipe's)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="another override for every run")
    ap.add_argument("--out", default="outputs/validate_reshard", help="folder for the runs, report.json and the plot")
    ap.add_argument("--plot", help="PNG path (default <out>/loss_curves.png)")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    ap.add_argument("--reference-cache", help="keep reference runs here and reuse those of the same identity")
    ap.add_argument("--inject-fault", choices=("drop-optimizer",), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    pairs = parse_pairs(args)
    if args.steps_before < 1 or args.steps_after < 1:
        raise SystemExit("--steps-before and --steps-after must be >= 1")
    backend, backend_note = choose_backend(args.backend, max(max(p) for p in pairs))
    extra = []
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set {item}: expected SECTION.KEY=VALUE")
        extra += [f"--{key}", value]
    settings = Settings(recipe=args.recipe, steps_before=args.steps_before, steps_after=args.steps_after,
                        global_batch=args.global_batch or None, local_batch=args.local_batch, extra=extra,
                        backend=backend)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.reference_cache).resolve() if args.reference_cache else None
    plot_path = Path(args.plot).resolve() if args.plot else out / "loss_curves.png"
    print(f"validate_reshard: {args.recipe}, pairs {', '.join(f'{a}->{b}' for a, b in pairs)}, "
          f"S={settings.steps_before}, K={settings.steps_after}, global batch {settings.global_batch or 'recipe'}; "
          f"backend: {backend_note}", flush=True)

    begin = time.monotonic()
    references: dict[int, Run] = {}
    # References at every size of the pairs: the sources are what the resumes
    # are compared with; all of them together measure the loss band.
    for n in sorted({n for pair in pairs for n in pair}):
        try:
            references[n] = reference_run(settings, n, out=out, cache=cache)
        except RuntimeError as e:  # nothing to validate against
            print(f"\nERROR: the reference run at {n} rank(s) failed: {e}", file=sys.stderr)
            return 2
    resumed, crashed = {}, []
    for a, b in pairs:
        try:
            resumed[(a, b)] = resume_run(settings, references[a], b, out / f"{a}-to-{b}", fault=args.inject_fault)
        except RuntimeError as e:  # the resume itself failed: that pair fails
            crashed.append(f"{a}->{b}: the resumed run failed: {e}")
    if crashed:
        print("\nFAILED:", file=sys.stderr)
        for line in crashed:
            print(f"  {line}", file=sys.stderr)
        return 1

    band = loss_band(references, settings)
    # N->N resumes read the very batches the reference read: exact losses.
    results = [evaluate(settings, references[a], resumed[(a, b)], 0.0 if a == b else band["band"]) for a, b in pairs]
    n_params = None
    any_ref = next(iter(references.values()))
    dumps = any_ref.dumps("save", settings.steps_before)
    if dumps:
        n_params = sum(math.prod(rec["shape"]) for rec in dumps[0]["params"].values())
    plot(results, settings, plot_path, references)
    report = {
        "recipe": args.recipe, "backend": backend, "backend_note": backend_note,
        "settings": asdict(settings), "loss_band": band,
        "tolerances": {"momentum_rel_l2": TOL_MOMENTUM, "vmean_rel_l2": TOL_VMEAN, "first_update_rel_l2": TOL_UPDATE,
                       "loss": f"max({LOSS_FLOOR}, {LOSS_K} * sigma)"},
        "parameters": n_params, "plot": str(plot_path), "fault": args.inject_fault,
        "pairs": [asdict(r) for r in results],
        "seconds": time.monotonic() - begin,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))

    print()
    print(table(results, n_params))
    refs = ", ".join(str(n) for n in sorted(references))
    print(f"\nbackend: {backend_note}\n"
          f"loss band (N->M): {band['band']:.4f} = max({LOSS_FLOOR}, {LOSS_K:g} x sigma), sigma {band['sigma']:.4f} = max("
          f"RMS difference between the references at {refs} ranks {band['sigma_between_references']:.4f}, "
          f"their second-difference noise {band['sigma_second_difference']:.4f}); N->N: exact\n"
          f"state after load (relative L2 where not bit-exact): momentum <= {TOL_MOMENTUM:g}, "
          f"vmean <= {TOL_VMEAN:g}, first update <= {TOL_UPDATE:g}; parameters and step counters exact")
    print(f"plot: {plot_path}\nreport: {out / 'report.json'}  ({time.monotonic() - begin:.0f} s)")
    failures = [f for r in results for f in r.failures]
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        print(f"  plot: {plot_path}\n  report: {out / 'report.json'}", file=sys.stderr)
        return 1
    print("all pairs within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
