"""The runs of a reshard validation: launches of ``gefen_titan.train`` and the reference cache.

Every run is ``python -m torch.distributed.run --nproc_per_node N -m
gefen_titan.train`` (or its ranks forked from one preloaded server,
``Settings.launcher``: ``gefen_titan.validation.launchers``) with the recipe, the settings' overrides and the dump
hooks of ``gefen_titan.validation.hooks`` (switched on through torchtitan's
``--override.imports``), so it trains the installed package as a user's
run does, from any directory. A run is at one side of a pair
(``gefen_titan.validation.layouts.Side``: N processes and, where the side
names one, its layout's degrees). A reference is the uninterrupted run at
a side that checkpoints at step S; a resume loads a copy of that checkpoint
at another side. References are kept under ``--reference-cache`` by their
identity (``gefen_titan.validation.identity``).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchtitan.config.override import format_cli_imports

from gefen_titan.checkpoint.io import storage
from gefen_titan.data.global_loader import GlobalOrderDataLoader
from gefen_titan.distributed import free_port
from gefen_titan.validation.identity import run_identity
from gefen_titan.validation.launchers import CPU_KERNELS_ENV, ENTRY, launch_ranks, torch_cpu_kernels
from gefen_titan.validation.layouts import Side, as_side, cuda_graph_flags, degree_flags, parse_side, recipe_degrees
from gefen_titan.validation.recipes import config_of, recipe_imports, resolve_recipe

__all__ = [
    "BATCH_HOOK", "CI_SETTINGS", "HOOK", "Run", "Settings",
    "checkpoint_bytes", "global_order_batch", "imports_flag", "launch", "parse_losses",
    "reference_run", "resume_run", "run_env",
]

HOOK = "gefen_titan.validation.hooks.dump_state"
BATCH_HOOK = "gefen_titan.validation.hooks.record_batches"
STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([0-9.eE+-]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")

# The settings CI uses (tests/integration/test_validate_reshard.py and the
# stored recipe curves, scripts/update_reference_curves.py): small, so a run
# is seconds of compute. Runs with equal settings share one reference (reference_cache).
CI_SETTINGS = {"steps_before": 4, "steps_after": 3, "global_batch": 8, "local_batch": 2}


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
    return ["--override.imports", *format_cli_imports([e if isinstance(e, str) else (e[0], e[1]) for e in imports])]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_bytes(step_dir: Path) -> dict[str, Any]:
    """Bytes on disk of the step-S checkpoint, and the optimizer's share of
    them (the stored lengths of the ``optimizer.`` items, from DCP's metadata)."""
    meta = storage.read_metadata(step_dir)  # checked and restricted, as every read of a checkpoint
    opt = sum(info.length for index, info in meta.storage_data.items() if index.fqn.startswith("optimizer."))
    return {"total": dir_bytes(step_dir), "optimizer": opt}


@dataclass
class Settings:
    recipe: str
    steps_before: int = 4
    steps_after: int = 3
    global_batch: int | None = 16
    local_batch: int | None = None
    extra: list[str] = field(default_factory=list)  # more "--section.key value" overrides
    backend: str = "gloo"
    blocking: str | None = None  # optimizer.blocking.mode for every run (None: the recipe's)
    launcher: str = "torchrun"  # how the ranks start (validation.launchers: "torchrun" or "fork")
    # torch's CPU kernels for every run (ATEN_CPU_CAPABILITY, e.g. "avx2"; None: the host's own). The stored
    # recipe curves pin "avx2", which every x86 CI host runs (docs/validation.md).
    cpu_kernels: str | None = None

    def env(self) -> dict[str, str]:
        """The environment of every run of these settings (``run_env`` and the pinned CPU kernels)."""
        env = run_env(self.backend)
        if self.cpu_kernels:
            env[CPU_KERNELS_ENV] = self.cpu_kernels
        return env

    def torch_cpu_kernels(self) -> str:
        """The kernels the runs get on this host, as torch names them (``AVX2``, ``AVX512``, ``DEFAULT``)."""
        return torch_cpu_kernels(self.cpu_kernels)

    @property
    def total_steps(self) -> int:
        return self.steps_before + self.steps_after

    def base_config(self) -> Any:
        """The config of the recipe with ``extra`` (``--set``), before any
        side's layout: where a bare side reads the recipe's own degrees."""
        return _base_config(resolve_recipe(self.recipe), tuple(self.extra))

    def degrees(self, side: Side | int) -> dict[str, int]:
        """Every layout degree of a side's runs (``Side.degrees``; LayoutError
        when they do not divide its processes)."""
        return as_side(side).degrees(recipe_degrees(self.base_config().parallelism))

    def overrides(self, side: Side | int) -> list[str]:
        """Overrides every run at ``side`` gets (reference and resume alike).

        A bare process count N is the side ``N``: the recipe's degrees, the
        shard degree what they leave of N (the only flag, as before layouts).
        """
        side = as_side(side)
        degrees = self.degrees(side)
        return self._overrides(degree_flags(side, degrees)) + cuda_graph_flags(
            degrees, bool(self.base_config().training.disable_cuda_graphs))

    def common_overrides(self) -> list[str]:
        """The overrides of every run whatever its side (no layout flags)."""
        return self._overrides([])

    def _overrides(self, layout: list[str]) -> list[str]:
        args = [
            "--training.steps", str(self.total_steps),
            *layout,
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
            args += ["--optimizer.blocking.mode", self.blocking]
        return args + list(self.extra)


@functools.lru_cache(maxsize=16)
def _base_config(recipe: str, extra: tuple[str, ...]) -> Any:
    return config_of(recipe, [*extra])


def global_order_batch(settings: Settings) -> int | None:
    """The global batch size when the runs use the DP-invariant global-order
    loader (``[dataloader] loader = "global_order"``), else None.

    With it every run reads the same global batch b at every DP size, so the
    resumed losses are compared with the reference's step by step
    (``bands.order_band``) and the batches themselves are checked (``Run.batches``).
    """
    config = config_of(settings.recipe, settings.common_overrides())
    if not isinstance(config.dataloader, GlobalOrderDataLoader.Config):
        return None
    return int(config.training.global_batch_size)


@dataclass
class Run:
    """One torchrun launch: its folder, log, loss curve and dumps."""

    folder: str
    nproc: int
    losses: dict[int, float]
    seconds: float
    identity: str = ""
    layout: str = ""  # the side's label where it names a layout ("2@tp2"); "" for a bare process count

    @property
    def side(self) -> Side:
        return parse_side(self.layout) if self.layout else Side(self.nproc)

    def dumps(self, kind: str, step: int) -> list[dict]:
        """The hook's dumps of a load or save: one per rank (per-rank
        blocking) or one per writer of the global state (agreed blocking)."""
        files = sorted(Path(self.folder, "validate").glob(f"{kind}-{step}-*rank*.pt"),
                       key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
        return [torch.load(f, weights_only=True) for f in files]

    def batches(self, global_batch: int) -> dict[int, list[int]]:
        """step -> the sorted global sample ids of that step's batch, from every
        rank's record (global-order runs only; ``hooks.record_batches``).

        The ranks of one data shard (TP, PP, CP) each record the same
        microbatch, each in its own file: it counts once where another
        rank's copy agrees. A copy that differs, or a rank that reads one
        microbatch twice, counts again, so the comparison sees the samples
        read twice.
        """
        out: dict[int, list[int]] = {}
        seen: dict[tuple[int, int], list[tuple[str, list[int]]]] = {}
        for f in sorted(Path(self.folder, "batches").glob("batches-*.jsonl")):
            for line in f.read_text().splitlines():
                row = json.loads(line)
                if "dp_rank" in row:
                    copies = seen.setdefault((row["start"], row["dp_rank"]), [])
                    if any(ids == row["sample_ids"] and name != f.name for name, ids in copies):
                        continue
                    copies.append((f.name, row["sample_ids"]))
                out.setdefault(row["start"] // global_batch + 1, []).extend(row["sample_ids"])
        return {step: sorted(ids) for step, ids in sorted(out.items())}


def launch(settings: Settings, side: Side | int, folder: Path, extra: list[str], *, save_steps: list[int],
           env: dict[str, str], quiet: bool = False) -> Run:
    """``torchrun --nproc_per_node N -m gefen_titan.train`` at ``side`` with the dump hook on (or its ranks
    forked, ``settings.launcher``: the same run). ``cmd`` in run.json is the torchrun command either way."""
    side = as_side(side)
    nproc = side.nproc
    folder.mkdir(parents=True, exist_ok=True)
    hook = [HOOK, {"dir": str(folder / "validate"), "save_steps": save_steps}]
    imports = recipe_imports(settings.recipe) + [hook]
    if global_order_batch(settings):
        imports.append([BATCH_HOOK, {"dir": str(folder / "batches")}])
    argv = ["--job.config", resolve_recipe(settings.recipe), "--job.dump_folder", str(folder),
            *settings.overrides(side), *extra, *imports_flag(imports)]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m", ENTRY, *argv]
    if not quiet:
        how = "torchrun" if settings.launcher == "torchrun" else f"{settings.launcher} launcher:"
        print(f"  $ {how} --nproc_per_node={nproc} -m {ENTRY} ... --job.dump_folder {folder} "
              f"{' '.join(extra)}", flush=True)
    begin = time.monotonic()
    returncode = launch_ranks(settings.launcher, nproc, argv, log=folder / "train.log", env=env, port=free_port())
    seconds = time.monotonic() - begin
    text = (folder / "train.log").read_text(errors="replace")
    if returncode != 0:
        raise RuntimeError(f"run in {folder} failed (exit {returncode}); last lines of {folder / 'train.log'}:\n"
                           + "\n".join(text.splitlines()[-40:]))
    run = Run(str(folder), nproc, parse_losses(text), seconds, layout="" if side.plain else side.label)
    (folder / "run.json").write_text(json.dumps({**asdict(run), "cmd": cmd}, indent=1))
    return run


def run_env(backend: str) -> dict[str, str]:
    env = dict(os.environ)
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even where GPUs are visible
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def reference_run(settings: Settings, side: Side | int, *, out: Path, cache: Path | None = None,
                  quiet: bool = False, tag: str = "ref") -> Run:
    """The uninterrupted S+K-step run at ``side`` (a bare process count: the
    recipe's degrees), dumped at step S.

    With ``cache``, a run of the same identity already there is reused (and a
    new one is kept there for the next caller). ``tag = "rerun"`` is a second,
    independent run of the same identity (the same-size rerun that measures
    run-to-run noise).
    """
    side = as_side(side)
    overrides = settings.overrides(side)
    identity = run_identity(settings.recipe, side.nproc, overrides, cpu_kernels=settings.torch_cpu_kernels())
    folder = (cache / f"{tag}-{side.label}-{identity}") if cache else (out / f"{tag}-{side.label}")
    if not cache:
        return _train_reference(settings, side, folder, identity, tag, quiet)
    # Callers in other processes share the cache (validate commands, the
    # suite's parallel workers): the first trains a run while the others wait
    # on its lock, then read it, so no run is trained twice or read half-written.
    (cache / ".locks").mkdir(parents=True, exist_ok=True)
    with open(cache / ".locks" / folder.name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _cached_reference(settings, side, folder, identity, tag, quiet)


def _cached_reference(settings: Settings, side: Side, folder: Path, identity: str, tag: str, quiet: bool) -> Run:
    done = folder / "run.json"
    if done.exists():
        run = Run(**{k: v for k, v in json.loads(done.read_text()).items() if k in Run.__dataclass_fields__})
        run.losses = {int(k): v for k, v in run.losses.items()}
        # The cache key is the run's config, not its spelling: a run cached
        # for an equal side (llama_gefen_tp2.toml at 2, llama_gefen.toml at
        # 2@tp2) is this side's run.
        run.layout = "" if side.plain else side.label
        if not quiet:
            print(f"  reference at {side.ranks()}: reusing {folder}", flush=True)
        return run
    return _train_reference(settings, side, folder, identity, tag, quiet)


def _train_reference(settings: Settings, side: Side, folder: Path, identity: str, tag: str, quiet: bool) -> Run:
    done = folder / "run.json"
    if folder.exists():
        shutil.rmtree(folder)
    if not quiet:
        what = "same-size rerun" if tag == "rerun" else "reference"
        print(f"  {what} at {side.ranks()}, {settings.total_steps} steps, checkpoint at {settings.steps_before}",
              flush=True)
    run = launch(settings, side, folder, [], save_steps=[settings.steps_before], env=settings.env(), quiet=quiet)
    run.identity = identity
    data = json.loads(done.read_text())
    data["identity"] = identity
    done.write_text(json.dumps(data, indent=1))
    return run


def resume_run(settings: Settings, ref: Run, side: Side | int, folder: Path, fault: str | None = None,
               measure: bool = False) -> Run:
    """The reference's step-S checkpoint, copied into ``folder``, loaded at
    ``side`` and trained K more steps (``fault``: a deliberately broken
    resume, for the validation's own test, or with ``measure`` the figure's
    measure of what that fault does to the loss)."""
    side = as_side(side)
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
    what = f"{ref.nproc} -> {side.nproc} rank(s)" if ref.side.plain and side.plain else \
        f"{ref.side.label} -> {side.label}"
    note = (" with the optimizer state dropped (for the figure)" if measure else f" [fault injected: {fault}]") \
        if fault else ""
    print(f"  resume {what} from step {step}, {settings.steps_after} more steps{note}", flush=True)
    return launch(settings, side, folder, extra, save_steps=[], env=settings.env())
