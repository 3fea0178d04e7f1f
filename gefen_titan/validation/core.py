"""End-to-end reshard validation: save at N data-parallel ranks, resume at M.

The command line is ``scripts/validate_reshard.py`` (and the standard set,
``scripts/reshard_smoke.sh``); this module is what it runs, and what
``tests/test_validate_reshard.py`` tests.

For every pair N:M, with S = ``steps_before`` and K = ``steps_after``:

1. reference: an uninterrupted run at N ranks for S+K steps that checkpoints
   at step S (``training.steps = S+K`` in every run, so the LR schedule is the
   same). Its step-S checkpoint is exactly what an interrupted run saves.
   There is one reference per size that appears in the pairs (targets too:
   they measure the loss band), shared by all pairs.
2. resume: the step-S checkpoint copied into the pair's own folder, loaded by
   ``torchrun --nproc_per_node M train.py`` (same recipe,
   ``--checkpoint.load_step S``), trained K more steps.
3. compare the state right after the load with the reference's state at the
   save (``gefen_titan.validation.hooks`` dumps both; it is switched on per run
   through torchtitan's ``--override.imports``):

   * agreed blocking (the default; checkpoint format v2): the dumps are the
     *global* state (every checkpoint entry gathered with ``full_tensor``,
     every parameter, and every rank's live periods, codebook, counters and
     hyperparameters). The load must reproduce it bit for bit, for every
     pair (splits and merges alike): ``compare_global_state``.
   * per-rank blocking (``blocking="per_rank"``; format v1): the dumps are per
     rank; parameters bit-exact, Gefen momentum and second moment bit-exact
     wherever the v1 adapter promises it (a target shard on whole blocks of
     one source rank, with that rank's codebook adopted), otherwise within
     the adapter's error bounds; step counters equal; other optimizers'
     state bit-exact: ``compare_state``.

   Both report the first update the loaded state gives against the
   reference state's (the Adam-style direction m / (sqrt(v) + eps) for a zero
   new gradient: the state's whole share of the next step's error), and the
   loss of steps S+1..S+K against the reference, step by step:

   * elastic loader (torchtitan's per-rank document order): within a band
     measured on the reference runs (the resumed run reads other documents:
     the elastic loader hands the unread documents to M ranks, so the losses
     cannot be equal; ``loss_band``); N->N resumes must match exactly.
   * global-order loader (``[dataloader] loader = "global_order"``): the
     resumed run must read the reference's very global batches (every run
     records them, ``compare_batches``), and its losses may differ only by
     arithmetic: by a same-size rerun's noise for N->N, and for N->M by what
     the references at the different sizes, which read the same batches
     too, differ by (another gradient reduction order): ``order_band``.
     The deviation of every step is reported.

   ``pair_loss_band`` picks the pair's tolerance.
4. prints a table (pair, loss deviation and band, state and first-update
   errors, whether the state is exact, checkpoint bytes, save/load seconds),
   writes ``report.json`` and a PNG of the loss curves (one panel per pair),
   and returns 1 naming each pair and figure that broke its tolerance.

The global batch is held fixed (``training.global_batch_size``, default 16;
torchtitan turns the per-rank ``local_batch_size`` into gradient
accumulation), so the curves at different DP sizes are comparable.

Backend: NCCL with one GPU per rank when ``torch.cuda.device_count()`` is at
least the largest rank count, else gloo on CPU (``CUDA_VISIBLE_DEVICES`` is
emptied for the runs); ``backend`` forces one.
"""

from __future__ import annotations

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

from gefen_titan.checkpoint import schema

ROOT = Path(__file__).resolve().parents[2]
HOOK = "gefen_titan.validation.hooks.dump_state"
BATCH_HOOK = "gefen_titan.validation.hooks.record_batches"
STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([0-9.eE+-]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")

__all__ = [
    "CI_SETTINGS", "LOG_RESOLUTION", "LOSS_FLOOR", "LOSS_K", "TOL_MOMENTUM", "TOL_UPDATE", "TOL_VMEAN",
    "PairResult", "Run", "Settings",
    "choose_backend", "compare_global_state", "compare_state", "evaluate", "global_order_batch", "loss_band", "order_band", "pair_loss_band",
    "parse_pairs", "parse_sets", "reference_run", "resume_run", "run_identity", "second_difference_noise",
    "table", "imports_flag", "validate",
]

# ---------------------------------------------------------------- tolerances
# Per-rank blocking (format v1), state after load where the adapter does not
# promise bit-exactness: the adapter's own bounds (tests/test_reshard.py): one
# requantization of the momentum against a merged codebook, block means of
# vmean. Agreed blocking (format v2) has no tolerance: every figure must be 0
# and every entry equal (TOLERANCES below).
TOL_MOMENTUM = 2e-2  # relative L2 of the dequantized momentum
TOL_VMEAN = 5e-2  # relative L2 of the per-element second moment
TOL_UPDATE = 3e-2  # relative L2 of the first update direction
TOLERANCES = {
    "per_rank": {"momentum_rel_l2": TOL_MOMENTUM, "vmean_rel_l2": TOL_VMEAN, "first_update_rel_l2": TOL_UPDATE},
    "agreed": {"momentum_rel_l2": 0.0, "vmean_rel_l2": 0.0, "first_update_rel_l2": 0.0},
}
# Loss: |resumed - reference| <= max(LOSS_FLOOR, LOSS_K * sigma), sigma the
# batch-to-batch noise of the loss measured on the reference curve(s); see
# loss_band() and docs/validation.md for the measurement.
LOSS_K = 3.0
LOSS_FLOOR = 0.02
# Global-order runs (order_band): the smallest tolerance, one unit of the 5
# decimals torchtitan logs the loss with.
LOG_RESOLUTION = 1e-5

# The settings CI uses (tests/test_validate_reshard.py and the stored recipe
# curves, scripts/update_reference_curves.py): small, so a run is seconds of
# compute. Runs with equal settings share one reference (reference_cache).
CI_SETTINGS = {"steps_before": 4, "steps_after": 3, "global_batch": 8, "local_batch": 2}


# ------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_losses(log: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for step, loss in STEP_RE.findall(ANSI_RE.sub("", log)):
        # Pipeline stages other than the last log a negative placeholder
        # (torchtitan: -1 per microbatch step); only the last stage has the loss.
        if float(loss) >= 0:
            out.setdefault(int(step), float(loss))
    return out


def imports_flag(imports: list[Any]) -> list[str]:
    """``--override.imports`` with these entries (a target, or [target,
    kwargs]), in torchtitan's CLI form (``target`` / ``target={json}``)."""
    from torchtitan.config.override import format_cli_imports

    return ["--override.imports", *format_cli_imports([e if isinstance(e, str) else (e[0], e[1]) for e in imports])]


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
    blocking: str | None = None  # optimizer.blocking for every run (None: the recipe's)

    @property
    def total_steps(self) -> int:
        return self.steps_before + self.steps_after

    def overrides(self, nproc: int) -> list[str]:
        """Overrides every run gets (reference and resume alike)."""
        from gefen_titan.recipe.files import read_recipe_tables

        # The data-parallel shard degree takes what the recipe's other
        # degrees (TP, PP, CP, replicate) leave of the processes.
        par = read_recipe_tables(resolve_recipe(self.recipe)).get("parallelism", {})
        others = 1
        for key in ("data_parallel_replicate_degree", "context_parallel_degree", "tensor_parallel_degree",
                    "pipeline_parallel_degree"):
            others *= max(1, int(par.get(key, 1)))
        shard = nproc // others if nproc % others == 0 else nproc
        args = [
            "--training.steps", str(self.total_steps),
            "--parallelism.data_parallel_shard_degree", str(shard),
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
        if self.blocking:
            args += ["--optimizer.blocking", self.blocking]
        return args + list(self.extra)


def resolve_recipe(recipe: str) -> str:
    """An absolute recipe path: as given if it exists from here, else from the repository root."""
    path = Path(recipe)
    if not path.is_absolute() and not path.exists():
        path = ROOT / recipe
    return str(path.resolve())


def merged_tables(recipe: str, overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The recipe's tables (``extends`` resolved) with the recipe flags of
    ``overrides`` merged in, and the other (torchtitan) flags as given."""
    from gefen_titan.recipe.cli import parse_cli
    from gefen_titan.recipe.files import merge_tables, read_recipe_tables

    recipe = resolve_recipe(recipe)
    data = read_recipe_tables(recipe)
    cl = parse_cli(["--job.config", recipe, *overrides])
    merge_tables(data, cl.overrides, recipe)
    return data, cl.args


def global_order_batch(settings: Settings) -> int | None:
    """The global batch size when the runs use the DP-invariant global-order
    loader (``[dataloader] loader = "global_order"``), else None.

    With it every run reads the same global batch b at every DP size, so the
    resumed losses are compared with the reference's step by step
    (``order_band``) and the batches themselves are checked (``batches``).
    """
    from gefen_titan.data.global_loader import GlobalOrderDataLoader
    from gefen_titan.recipe.build import build_recipe
    from gefen_titan.recipe.cli import parse_cli, parse_flags

    # The config the runs build (recipe, then the flags over it), without the
    # mesh check: this is asked once for all sizes.
    cl = parse_cli(["--job.config", resolve_recipe(settings.recipe), *settings.overrides(1)])
    config = parse_flags(build_recipe(cl.path, cl.overrides).config, cl.args)
    if not isinstance(config.dataloader, GlobalOrderDataLoader.Config):
        return None
    return int(config.training.global_batch_size)


def run_identity(recipe: str, nproc: int, overrides: list[str]) -> str:
    """What a run computes: the merged recipe tables plus the recipe flags of
    the overrides, with the fields that do not change training (description,
    dump folder) left out, the other (torchtitan) flags as given, and the
    version of the state dumps it holds.

    Two recipes that resolve to the same tables (``llama_gefen.toml`` at 2
    ranks and ``llama_gefen_dp2.toml``) are the same run.
    """
    from gefen_titan.validation.hooks import DUMP_VERSION

    data, flags = merged_tables(recipe, overrides)
    job = data.get("job", {})
    for key in ("description", "dump_folder", "extends"):
        job.pop(key, None)
    par = data.setdefault("parallelism", {})
    if par.get("data_parallel_shard_degree", -1) == -1:
        par["data_parallel_shard_degree"] = nproc
    blob = json.dumps({"nproc": nproc, "tables": data, "flags": flags, "dumps": DUMP_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def recipe_imports(recipe: str) -> list[Any]:
    from gefen_titan.recipe.build import load_recipe
    from gefen_titan.recipe.files import declared_world_size

    # Only [override] is read: any world size the recipe's own mesh accepts.
    path = resolve_recipe(recipe)
    imports = load_recipe(path, world_size=declared_world_size(path)).config.override.imports
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
        """The hook's dumps of a load or save: one per rank (per-rank
        blocking) or one per writer of the global state (agreed blocking)."""
        import torch

        files = sorted(Path(self.folder, "validate").glob(f"{kind}-{step}-*rank*.pt"),
                       key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
        return [torch.load(f, weights_only=True) for f in files]

    def batches(self, global_batch: int) -> dict[int, list[int]]:
        """step -> the sorted global sample ids of that step's batch, from every
        rank's record (global-order runs only; ``validate_hooks.record_batches``)."""
        out: dict[int, list[int]] = {}
        for f in Path(self.folder, "batches").glob("batches-*.jsonl"):
            for line in f.read_text().splitlines():
                row = json.loads(line)
                out.setdefault(row["start"] // global_batch + 1, []).extend(row["sample_ids"])
        return {step: sorted(ids) for step, ids in sorted(out.items())}


def launch(settings: Settings, nproc: int, folder: Path, extra: list[str], *, save_steps: list[int],
           env: dict[str, str], quiet: bool = False) -> Run:
    """``torchrun --nproc_per_node nproc train.py`` with the dump hook on."""
    folder.mkdir(parents=True, exist_ok=True)
    hook = [HOOK, {"dir": str(folder / "validate"), "save_steps": save_steps}]
    imports = recipe_imports(settings.recipe) + [hook]
    if global_order_batch(settings):
        imports.append([BATCH_HOOK, {"dir": str(folder / "batches")}])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master-port={free_port()}", str(ROOT / "train.py"),
        "--job.config", resolve_recipe(settings.recipe), "--job.dump_folder", str(folder),
        *settings.overrides(nproc), *extra,
        *imports_flag(imports),
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


def reference_run(settings: Settings, nproc: int, *, out: Path, cache: Path | None = None, quiet: bool = False,
                  tag: str = "ref") -> Run:
    """The uninterrupted S+K-step run at ``nproc`` ranks, dumped at step S.

    With ``cache``, a run of the same identity already there is reused (and a
    new one is kept there for the next caller). ``tag = "rerun"`` is a second,
    independent run of the same identity (the same-size rerun that measures
    run-to-run noise).
    """
    overrides = settings.overrides(nproc)
    identity = run_identity(settings.recipe, nproc, overrides)
    folder = (cache / f"{tag}-{nproc}-{identity}") if cache else (out / f"{tag}-{nproc}")
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
        what = "same-size rerun" if tag == "rerun" else "reference"
        print(f"  {what} at {nproc} rank(s), {settings.total_steps} steps, checkpoint at {settings.steps_before}", flush=True)
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


def _rel(a, b) -> float:
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm() > 0)


def _first_update(m, v, hyper: dict[str, float], vstep: int):
    """The update of a zero new gradient: m' = b1 m, v' = b2 v, one more step
    for the bias correction; the constant b1 / bc1 cancels in relative errors."""
    bc2 = 1 - hyper["beta2"] ** vstep
    return m / ((hyper["beta2"] * v / bc2).clamp_min(0).sqrt() + hyper["eps"])


# ------------------------------------------- state analysis: agreed blocking
def merge_global(dumps: list[dict]) -> dict[str, Any]:
    """One global picture from the writers' dumps of one load or save."""
    world = dumps[0]["world"]
    params: dict[str, Any] = {}
    state: dict[str, Any] = {}
    covered: set[int] = set()
    for d in dumps:
        params.update(d["params"])
        state.update(d["state"])
        covered.update(d["covers"])
    return {"world": world, "params": params, "state": state, "live": dumps[0]["live"],
            "complete": covered == set(range(world)), "seconds": max(dumps[0]["seconds"], default=float("nan"))}


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return a == b


def _records(state: dict[str, Any]) -> dict[str, tuple[str, schema.ParamRecord]]:
    """fqn -> (optimizer id, the saved v2 record of a Gefen parameter)."""
    out = {}
    for key, value in state.items():
        parsed = schema.parse_key(key)
        if parsed is not None and parsed.kind == "optimizer":
            for p in schema.OptimizerRecord.from_json(value, parsed.name).params:
                out[p.fqn] = (parsed.name, p)
    return out


def _record_difference(a: str, b: str, opt: str) -> str:
    """The first field in which two records of an optimizer differ."""
    try:
        ra, rb = schema.OptimizerRecord.from_json(a, opt), schema.OptimizerRecord.from_json(b, opt)
    except schema.FormatError as e:
        return str(e)
    for key in ("blocking", "deterministic", "global_step"):
        if getattr(ra, key) != getattr(rb, key):
            return f"{key} {getattr(rb, key)} != saved {getattr(ra, key)}"
    pa = {p.fqn: p.to_dict() for p in ra.params}
    pb = {p.fqn: p.to_dict() for p in rb.params}
    for fqn in pa:
        if fqn not in pb:
            return f"{fqn} missing"
        for key in sorted(set(pa[fqn]) | set(pb[fqn])):
            if pa[fqn].get(key) != pb[fqn].get(key):
                return f"{fqn} {key} {pb[fqn].get(key)} != saved {pa[fqn].get(key)}"
    return "parameter order"


def _dense(state: dict[str, Any], fqn: str, period: int, codebook):
    """Dense momentum and per-element vmean of one parameter from v2 entries
    (Gefen's dequantization: codebook[codes] * magnitude), or None."""
    keys = schema.param_tensor_keys(fqn)
    codes, mag, vmean = (state.get(keys[name]) for name in schema.PARAM_TENSORS)
    if codes is None or mag is None or vmean is None or codebook is None:
        return None
    m = codebook.float().index_select(0, codes.reshape(-1).long()).reshape(codes.shape)
    if codes.dim():
        m = m * mag.float().repeat_interleave(period, dim=-1)
        v = vmean.float().repeat_interleave(period, dim=-1)
    else:
        m, v = m * mag.float(), vmean.float()
    return m.reshape(-1), v.reshape(-1)


def compare_global_state(ref_dumps: list[dict], res_dumps: list[dict]) -> dict[str, Any]:
    """Agreed blocking (format v2): the global state right after the load
    against the global state at the save. Everything must be bit-exact.

    * every parameter (gathered) equal in dtype and value;
    * every entry of the optimizer container's ``state_dict()`` (Gefen codes,
      magnitudes, ``vmean``, records and codebook; other optimizers' flat
      state), gathered, equal; none missing, none extra;
    * on every rank of the resumed run, the live facts equal the saved job's:
      each Gefen parameter's period, step, ``vmean_step`` and
      hyperparameters, each Gefen optimizer's codebook (on every rank that
      holds state) and global step.

    The momentum, ``vmean`` and first-update errors are computed as for
    per-rank blocking (and are 0 when the state is exact).
    """
    import torch

    ref, res = merge_global(ref_dumps), merge_global(res_dumps)
    problems: list[str] = []
    if not ref["complete"] or not res["complete"]:
        problems.append("the global dumps do not cover every rank")

    param_mismatch = [fqn for fqn, t in ref["params"].items() if not _same(t, res["params"].get(fqn))]
    param_mismatch += [fqn for fqn in res["params"] if fqn not in ref["params"]]
    if param_mismatch:
        problems.append(f"parameters differ after load ({len(param_mismatch)}: {', '.join(param_mismatch[:3])})")

    # Every checkpoint entry.
    rs, ss = ref["state"], res["state"]
    differ: list[str] = []
    for key, value in rs.items():
        if key not in ss:
            differ.append(f"{key} (missing)")
        elif not _same(value, ss[key]):
            parsed = schema.parse_key(key)
            if parsed is not None and parsed.kind == "optimizer":
                differ.append(f"{key} ({_record_difference(value, ss[key], parsed.name)})")
            else:
                differ.append(key)
    differ += [f"{key} (extra)" for key in ss if key not in rs]
    gefen_differ = [d for d in differ if schema.is_gefen_key(d)]
    other_differ = [d for d in differ if not schema.is_gefen_key(d)]

    # Live facts on every rank against the saved job's.
    saved_params: dict[str, dict] = {}
    saved_opts: dict[str, dict] = {}
    for live in ref["live"]:
        for fqn, rec in live["params"].items():
            saved_params.setdefault(fqn, rec)
        for opt_id, rec in live["optimizers"].items():
            if opt_id not in saved_opts or saved_opts[opt_id]["codebook"] is None:
                saved_opts[opt_id] = rec
    counters, lrs, books, gsteps = [], [], [], []
    for rank, live in enumerate(res["live"]):
        for fqn, rec in live["params"].items():
            want = saved_params.get(fqn)
            if want is None:
                continue
            got = (rec["period"], rec["step"], rec["vmean_step"])
            saved = (want["period"], want["step"], want["vmean_step"])
            if got != saved:
                counters.append(f"{fqn} on rank {rank}: {got} != saved {saved}")
            if rec["hyper"] != want["hyper"]:
                lrs.append(f"{fqn} on rank {rank}: lr {rec['hyper']['lr']:g} != saved {want['hyper']['lr']:g}"
                           if rec["hyper"]["lr"] != want["hyper"]["lr"] else f"{fqn} on rank {rank}: {rec['hyper']}")
        for opt_id, rec in live["optimizers"].items():
            want = saved_opts.get(opt_id)
            if want is None:
                continue
            holds = any(p["has_state"] for p in live["params"].values() if p["optimizer"] == opt_id)
            cb = rec["codebook"]
            if (cb is None and holds) or (cb is not None and not _same(want["codebook"], cb)):
                books.append(f"{opt_id} on rank {rank}")
            if rec["global_step"] != want["global_step"]:
                gsteps.append(f"{opt_id} on rank {rank}: {rec['global_step']} != saved {want['global_step']}")
    if counters:
        problems.append(f"step counters (period, step, vmean_step) differ after the load in {len(counters)} "
                        f"(parameter, rank) pairs, e.g. {counters[0]}")
    if lrs:
        problems.append(f"learning rate or other hyperparameters differ after the load in {len(lrs)} "
                        f"(parameter, rank) pairs, e.g. {lrs[0]}")
    if books:
        problems.append(f"the live codebook differs from the saved one ({len(books)}: {', '.join(books[:3])})")
    if gsteps:
        problems.append(f"global step differs after the load ({len(gsteps)}, e.g. {gsteps[0]})")

    # Dense figures (0 where exact), over the saved Gefen parameters with state.
    records = _records(rs)
    num = {"m": 0.0, "v": 0.0, "u": 0.0}
    den = {"m": 0.0, "v": 0.0, "u": 0.0}
    worst_update, total, missing = 0.0, 0, 0
    for fqn, (opt_id, rec) in records.items():
        period = rec.period
        if not period:
            continue
        cb_ref = rs.get(schema.codebook_key(opt_id))
        saved = _dense(rs, fqn, period, cb_ref)
        if saved is None:
            continue
        m_ref, v_ref = saved
        total += m_ref.numel()
        loaded = _dense(ss, fqn, period, ss.get(schema.codebook_key(opt_id)))
        if loaded is None:
            missing += m_ref.numel()
            m_res, v_res = torch.zeros_like(m_ref), torch.zeros_like(v_ref)
        else:
            m_res, v_res = loaded
        vstep = rec.vmean_step + 1
        u_ref = _first_update(m_ref, v_ref, rec.group, vstep)
        u_res = _first_update(m_res, v_res, rec.group, vstep)
        for key, (a, b) in {"m": (m_res, m_ref), "v": (v_res, v_ref), "u": (u_res, u_ref)}.items():
            num[key] += float((a - b).double().square().sum())
            den[key] += float(b.double().square().sum())
        worst_update = max(worst_update, _rel(u_res, u_ref))
    if missing:
        problems.append(f"{missing} of {total} Gefen elements have no optimizer state after the load")
    if gefen_differ:
        problems.append(f"Gefen state after the load is not bit-exact (format v2 promises it): {len(gefen_differ)} "
                        f"of {sum(schema.is_gefen_key(k) for k in rs)} checkpoint entries differ, e.g. "
                        f"{', '.join(gefen_differ[:3])}")
    if other_differ:
        problems.append(f"non-Gefen optimizer state differs after load ({', '.join(other_differ[:3])})")

    rel = {k: math.sqrt(num[k] / den[k]) if den[k] > 0 else 0.0 for k in num}
    exact = not problems
    return {
        "blocking": "agreed",
        "exact": exact,
        "params_exact": not param_mismatch,
        "momentum_rel_l2": rel["m"],
        "vmean_rel_l2": rel["v"],
        "first_update_rel_l2": rel["u"],
        "first_update_worst_param": worst_update,
        "entries": len(rs),
        "entries_differ": differ,
        "gefen_elements": total,
        "problems": problems,
    }


# ----------------------------------------- state analysis: per-rank blocking
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
    """Element ranges where the v1 adapter promises a bit-exact state.

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


def compare_state(ref_dumps: list[dict], res_dumps: list[dict]) -> dict[str, Any]:
    """Per-rank blocking (format v1): the resumed run's state right after the
    load against the reference's state at the save, from per-rank dumps."""
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
        h = r["hyper"]
        vstep = max(r["vsteps"] or {0}) + 1
        u_ref = _first_update(r["m"], r["v"], h, vstep)
        u_res = _first_update(s["m"], s["v"], h, vstep)
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
    fraction = exact_elems / total if total else 0.0
    return {
        "blocking": "per_rank",
        "exact": not problems and fraction == 1.0 and rel["m"] == rel["v"] == rel["u"] == 0.0,
        "params_exact": not param_mismatch,
        "momentum_rel_l2": rel["m"],
        "vmean_rel_l2": rel["v"],
        "first_update_rel_l2": rel["u"],
        "first_update_worst_param": worst_update,
        "exact_promised_fraction": fraction,
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


def dumps_blocking(dumps: list[dict]) -> str:
    return dumps[0].get("blocking", "per_rank") if dumps else ""


def dumps_complete(dumps: list[dict], nproc: int) -> bool:
    if not dumps:
        return False
    if dumps_blocking(dumps) == "agreed":
        return dumps[0]["world"] == nproc and merge_global(dumps)["complete"]
    return len(dumps) == nproc


def dumps_seconds(dumps: list[dict]) -> float:
    if not dumps:
        return float("nan")
    if dumps_blocking(dumps) == "agreed":
        return max(dumps[0]["seconds"], default=float("nan"))
    return max(d["seconds"] for d in dumps)


def dumps_params(dumps: list[dict]) -> int | None:
    """Parameter count of the model from a save's dumps."""
    if not dumps:
        return None
    if dumps_blocking(dumps) == "agreed":
        return sum(t.numel() for t in merge_global(dumps)["params"].values())
    return sum(math.prod(rec["shape"]) for rec in dumps[0]["params"].values())


# ---------------------------------------------------------------- checkpoint
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


def order_band(references: dict[int, Run], rerun: Run | None, settings: Settings) -> dict[str, Any]:
    """The loss tolerances when every run reads the same global batches.

    With the global-order loader the resumed run at M reads, from the resume
    on, exactly the reference's batches from the reference's exact state
    (format v2), so nothing but the arithmetic can make its losses differ:

    * N->N: the same arithmetic. The tolerance is LOSS_K x the largest
      deviation of a same-size rerun (a second uninterrupted run at the
      first source size) from its reference over all steps: 0 where runs
      are deterministic (CPU), the run-to-run noise where they are not.
    * N->M: the gradients of the same samples are summed in another order
      (M ranks of other microbatch counts). The references at the different
      sizes read the same batches too, so their largest deviation over
      steps S+1..S+K measures exactly that effect (from step 1 on: an upper
      bound for a resume, whose runs part only at step S). The tolerance is
      LOSS_K x the larger of the two.

    Both are at least ``LOG_RESOLUTION``: the logged losses have 5 decimals,
    so one rounding flip is 1e-5.
    """
    window = range(settings.steps_before + 1, settings.total_steps + 1)
    rerun_dev = 0.0
    if rerun is not None:
        ref = references[rerun.nproc]
        rerun_dev = max((abs(rerun.losses[t] - ref.losses[t]) for t in ref.losses if t in rerun.losses), default=0.0)
    runs = list(references.values())
    reduction_dev = max((abs(a.losses[t] - b.losses[t]) for i, a in enumerate(runs) for b in runs[i + 1:]
                         for t in window if t in a.losses and t in b.losses), default=0.0)
    return {"order": "global", "rerun_size": rerun.nproc if rerun else None,
            "rerun_deviation": rerun_dev, "reduction_order_deviation": reduction_dev,
            "band_same_size": max(LOG_RESOLUTION, LOSS_K * rerun_dev),
            "band": max(LOG_RESOLUTION, LOSS_K * max(rerun_dev, reduction_dev)),
            "references": sorted(references)}


def pair_loss_band(source: int, target: int, band: dict[str, Any]) -> float:
    """The loss tolerance of one pair N->M, from ``loss_band`` or ``order_band``.

    With the elastic loader (``loss_band``) the document order depends on the
    DP size: only N->N resumes read the reference's very batches (and must
    match it exactly, 0.0); N->M gets the measured data-order band. With the
    global-order loader (``order_band``) every pair reads the reference's
    batches: N->N gets the same-size rerun's band, N->M the reduction-order
    band.
    """
    if band.get("order") == "global":
        return band["band_same_size"] if source == target else band["band"]
    return 0.0 if source == target else band["band"]


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
    step_deviations: dict[int, float] = field(default_factory=dict)  # step -> |resumed - reference|
    data_order: str = "per_dp_size"  # or "global": the same global batches at every size
    batches_equal: bool | None = None  # global order: the resumed run read the reference's batches


def compare_batches(ref: Run, res: Run, global_batch: int, steps: range) -> list[str]:
    """Problems (none when equal) of the resumed run's global batches against
    the reference's, at the given steps."""
    want, got = ref.batches(global_batch), res.batches(global_batch)
    problems = []
    for t in steps:
        if t not in want or t not in got:
            problems.append(f"no batch record for step {t} ({'reference' if t not in want else 'resumed run'})")
        elif want[t] != got[t]:
            extra, lost = sorted(set(got[t]) - set(want[t])), sorted(set(want[t]) - set(got[t]))
            problems.append(f"step {t} read other samples than the uninterrupted run at {ref.nproc} rank(s) "
                            f"({len(extra)} not in it, e.g. {extra[:3]}; {len(lost)} missing, e.g. {lost[:3]})"
                            if extra or lost else f"step {t} read some samples twice")
    return problems


def evaluate(settings: Settings, ref: Run, res: Run, band: float, global_batch: int | None = None) -> PairResult:
    pair = f"{ref.nproc}->{res.nproc}"
    s = settings.steps_before
    window = range(s + 1, settings.total_steps + 1)
    failures = []
    missing_steps = [t for t in window if t not in res.losses or t not in ref.losses]
    if missing_steps:
        failures.append(f"{pair}: no loss logged for step(s) {missing_steps}")
    step_devs = {t: abs(res.losses[t] - ref.losses[t]) for t in window if t in res.losses and t in ref.losses}
    dev = max(step_devs.values()) if step_devs else float("inf")
    batches_equal = None
    if global_batch:
        batch_problems = compare_batches(ref, res, global_batch, window)
        batches_equal = not batch_problems
        failures += [f"{pair}: {p}" for p in batch_problems]
    if not all(math.isfinite(res.losses.get(t, float("nan"))) for t in window):
        failures.append(f"{pair}: non-finite loss after resume")
    if dev > band:
        failures.append(f"{pair}: max loss deviation {dev:.4f} > band {band:.4f}")

    ref_dumps, res_dumps = ref.dumps("save", s), res.dumps("load", s)
    blocking = dumps_blocking(ref_dumps) or dumps_blocking(res_dumps)
    if not (dumps_complete(ref_dumps, ref.nproc) and dumps_complete(res_dumps, res.nproc)) \
            or dumps_blocking(res_dumps) != blocking:
        failures.append(f"{pair}: state dumps missing or mismatched ({len(ref_dumps)} file(s) saved at {ref.nproc} "
                        f"rank(s), {len(res_dumps)} loaded at {res.nproc}; blocking "
                        f"{dumps_blocking(ref_dumps) or '?'} / {dumps_blocking(res_dumps) or '?'})")
        state: dict[str, Any] = {"blocking": blocking, "exact": False, "problems": ["no dumps"]}
    else:
        state = (compare_global_state if blocking == "agreed" else compare_state)(ref_dumps, res_dumps)
        failures += [f"{pair}: {p}" for p in state["problems"]]
        for key, what in (("momentum_rel_l2", "momentum error"), ("vmean_rel_l2", "second-moment error"),
                          ("first_update_rel_l2", "first-update error")):
            tol = TOLERANCES[blocking][key]
            if not state[key] <= tol:
                failures.append(f"{pair}: {what} {state[key]:.3g} > {tol:g}")
    ckpt = checkpoint_bytes(Path(ref.folder, "checkpoint", f"step-{s}"))
    return PairResult(pair, ref.nproc, res.nproc, settings.backend, ref.losses, res.losses, dev, band,
                      state, ckpt, dumps_seconds(ref_dumps), dumps_seconds(res_dumps), failures, step_devs,
                      "global" if global_batch else "per_dp_size", batches_equal)


def state_verdict(state: dict[str, Any]) -> str:
    """The table's ``state`` column: ``exact`` when the state after the load
    equals the saved state bit for bit."""
    if state.get("exact"):
        return "exact"
    if state.get("blocking") == "per_rank" and "exact_promised_fraction" in state:
        # v1: the share of the elements the adapter promises exact (the rest within bounds)
        return f"{100 * state['exact_promised_fraction']:.0f}% exact" + ("" if state.get("exact_held") else " BROKEN")
    return "DIFFER"


def _loss_figure(x: float) -> str:
    # Global-order tolerances sit at float rounding, far below 4 decimals.
    return f"{x:.4f}" if x == 0 or x >= 1e-3 else f"{x:.1e}"


def table(results: list[PairResult], n_params: int | None) -> str:
    head = ("pair", "max|dloss|", "band", "momentum", "vmean", "1st update", "state", "params",
            "ckpt MB", "opt B/param", "save s", "load s", "verdict")
    rows = [head]
    for r in results:
        st = r.state
        opt_bpp = r.checkpoint["optimizer"] / n_params if n_params else float("nan")
        rows.append((
            r.pair, _loss_figure(r.loss_deviation), _loss_figure(r.loss_band),
            f"{st.get('momentum_rel_l2', float('nan')):.2e}", f"{st.get('vmean_rel_l2', float('nan')):.2e}",
            f"{st.get('first_update_rel_l2', float('nan')):.2e}", state_verdict(st),
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
        state = "state exact" if r.state.get("exact") else \
            f"1st upd {r.state.get('first_update_rel_l2', float('nan')):.1e}"
        ax.set_title(f"{r.pair}: |dloss| {r.loss_deviation:.3f}, {state}" + (" FAIL" if r.failures else ""), fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("loss", fontsize=8)
    blocking = next((r.state.get("blocking") for r in results if r.state.get("blocking")), None)
    fig.suptitle(f"{Path(settings.recipe).name}: save at step {s}, resume, {settings.steps_after} more steps "
                 f"({settings.backend}{', ' + blocking + ' blocking' if blocking else ''})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------- the run
def parse_pairs(pairs: str | None, source: int | None = None, target: int | None = None) -> list[tuple[int, int]]:
    """``"2:4,4:2"`` (or one ``source``/``target``) as [(2, 4), (4, 2)]."""
    if pairs:
        out = []
        for item in pairs.split(","):
            a, _, b = item.strip().partition(":")
            out.append((int(a), int(b)))
        return out
    if source is None or target is None:
        raise SystemExit("give --from N --to M, or --pairs N:M,...")
    return [(source, target)]


def parse_sets(items: list[str]) -> list[str]:
    """``["section.key=value", ...]`` as torchtitan CLI overrides."""
    extra = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--set {item}: expected SECTION.KEY=VALUE")
        extra += [f"--{key}", value]
    return extra


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


def validate(*, recipe: str = "recipes/llama_gefen.toml", pairs: str | None = None, source: int | None = None,
             target: int | None = None, steps_before: int = 4, steps_after: int = 3, global_batch: int = 16,
             local_batch: int | None = None, sets: list[str] | None = None,
             out: str = "outputs/validate_reshard", plot_path: str | None = None, backend: str = "auto",
             reference_cache: str | None = None, blocking: str | None = None,
             inject_fault: str | None = None) -> int:
    """The whole validation (``scripts/validate_reshard.py`` passes its options).

    Returns 0 when every pair is within tolerance, 1 naming each pair and
    figure that is not (or each resume that failed), 2 when a reference run
    failed (nothing to validate against).
    """
    pair_list = parse_pairs(pairs, source, target)
    if steps_before < 1 or steps_after < 1:
        raise SystemExit("--steps-before and --steps-after must be >= 1")
    if blocking not in (None, "agreed", "per_rank"):
        raise SystemExit(f"--blocking must be agreed or per_rank, got {blocking!r}")
    chosen, backend_note = choose_backend(backend, max(max(p) for p in pair_list))
    settings = Settings(recipe=recipe, steps_before=steps_before, steps_after=steps_after,
                        global_batch=global_batch or None, local_batch=local_batch, extra=parse_sets(sets or []),
                        backend=chosen, blocking=blocking)
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(reference_cache).resolve() if reference_cache else None
    png = Path(plot_path).resolve() if plot_path else out_dir / "loss_curves.png"
    print(f"validate_reshard: {recipe}, pairs {', '.join(f'{a}->{b}' for a, b in pair_list)}, "
          f"S={settings.steps_before}, K={settings.steps_after}, global batch {settings.global_batch or 'recipe'}, "
          f"blocking {blocking or 'of the recipe'}; backend: {backend_note}", flush=True)

    begin = time.monotonic()
    references: dict[int, Run] = {}
    # References at every size of the pairs: the sources are what the resumes
    # are compared with; all of them together measure the loss band.
    for n in sorted({n for pair in pair_list for n in pair}):
        try:
            references[n] = reference_run(settings, n, out=out_dir, cache=cache)
        except RuntimeError as e:  # nothing to validate against
            print(f"\nERROR: the reference run at {n} rank(s) failed: {e}", file=sys.stderr)
            return 2
    global_batch = global_order_batch(settings)
    rerun = None
    if global_batch:
        # The same-size rerun whose run-to-run noise sets the N->N tolerance.
        try:
            rerun = reference_run(settings, pair_list[0][0], out=out_dir, cache=cache, tag="rerun")
        except RuntimeError as e:
            print(f"\nERROR: the same-size rerun at {pair_list[0][0]} rank(s) failed: {e}", file=sys.stderr)
            return 2
    resumed, crashed = {}, []
    for a, b in pair_list:
        try:
            resumed[(a, b)] = resume_run(settings, references[a], b, out_dir / f"{a}-to-{b}", fault=inject_fault)
        except RuntimeError as e:  # the resume itself failed: that pair fails
            crashed.append(f"{a}->{b}: the resumed run failed: {e}")
    if crashed:
        print("\nFAILED:", file=sys.stderr)
        for line in crashed:
            print(f"  {line}", file=sys.stderr)
        return 1

    band = order_band(references, rerun, settings) if global_batch else loss_band(references, settings)
    results = [evaluate(settings, references[a], resumed[(a, b)], pair_loss_band(a, b, band), global_batch)
               for a, b in pair_list]
    if global_batch:
        # The DP-invariance the comparison rests on: every uninterrupted run
        # read the same global batches.
        first, *others = sorted(references)
        for n in others:
            problems = compare_batches(references[first], references[n], global_batch,
                                       range(1, settings.total_steps + 1))
            results[0].failures += [f"references at {first} and {n} rank(s): {p}" for p in problems]
    n_params = dumps_params(next(iter(references.values())).dumps("save", settings.steps_before))
    plot(results, settings, png, references)
    used = sorted({r.state.get("blocking") or "?" for r in results})
    report = {
        "recipe": recipe, "backend": chosen, "backend_note": backend_note, "blocking": used,
        "settings": asdict(settings), "loss_band": band,
        "data_order": "global" if global_batch else "per_dp_size",
        "tolerances": {**{b: TOLERANCES[b] for b in used if b in TOLERANCES},
                       "loss": (f"N->N max({LOG_RESOLUTION}, {LOSS_K} * rerun deviation); N->M max({LOG_RESOLUTION}, "
                                f"{LOSS_K} * max(rerun, reduction-order deviation))" if global_batch
                                else f"max({LOSS_FLOOR}, {LOSS_K} * sigma)")},
        "parameters": n_params, "plot": str(png), "fault": inject_fault,
        "pairs": [asdict(r) for r in results],
        "seconds": time.monotonic() - begin,
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))

    print()
    print(table(results, n_params))
    refs = ", ".join(str(n) for n in sorted(references))
    print(f"\nbackend: {backend_note}")
    if global_batch:
        print(f"data order: global (the same {global_batch} samples in global batch b at every size); "
              "every resumed run read the uninterrupted run's batches" if all(r.batches_equal for r in results)
              else f"data order: global ({global_batch} samples a step); BATCHES DIFFER (see below)")
        print("loss deviation per step, |resumed - uninterrupted at the source size|:")
        for r in results:
            print(f"  {r.pair}: " + ", ".join(f"step {t} {d:.1e}" for t, d in sorted(r.step_deviations.items()))
                  + f"  (tolerance {r.loss_band:.1e})")
        print(f"tolerance: N->N {band['band_same_size']:.1e} = max({LOG_RESOLUTION:g}, {LOSS_K:g} x the same-size "
              f"rerun's deviation {band['rerun_deviation']:.1e} at {band['rerun_size']} rank(s)); N->M "
              f"{band['band']:.1e} = max({LOG_RESOLUTION:g}, {LOSS_K:g} x max(that, the references at {refs} ranks' "
              f"deviation {band['reduction_order_deviation']:.1e}: same batches, other gradient reduction order))")
    else:
        print(f"loss band (N->M): {band['band']:.4f} = max({LOSS_FLOOR}, {LOSS_K:g} x sigma), sigma {band['sigma']:.4f} = max("
              f"RMS difference between the references at {refs} ranks {band['sigma_between_references']:.4f}, "
              f"their second-difference noise {band['sigma_second_difference']:.4f}); N->N: exact")
    for b in used:
        if b == "agreed":
            print("state after load (agreed blocking, checkpoint format v2): bit-exact for every pair: every "
                  "checkpoint entry and parameter gathered to global tensors, and every rank's periods, "
                  "codebook, counters and hyperparameters, equal to the save's")
        elif b == "per_rank":
            print(f"state after load (per-rank blocking, format v1; relative L2 where not bit-exact): "
                  f"momentum <= {TOL_MOMENTUM:g}, vmean <= {TOL_VMEAN:g}, first update <= {TOL_UPDATE:g}; "
                  "parameters and step counters exact")
    print(f"plot: {png}\nreport: {out_dir / 'report.json'}  ({time.monotonic() - begin:.0f} s)")
    failures = [f for r in results for f in r.failures]
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        print(f"  plot: {png}\n  report: {out_dir / 'report.json'}", file=sys.stderr)
        return 1
    print("all pairs within tolerance")
    return 0
