"""Which parallel layouts torchtitan 0.3.0's mixture-of-experts models train in on CPU (gloo).

Command line: ``scripts/probe_moe_layouts.py`` (docs/moe.md holds the table it
printed). For every layout of ``LAYOUTS`` it runs the MoE recipe a few steps
with torchrun and the layout's flags, and reports one row: trains (the
losses), refused (torchtitan's message) or crashes (the error), and, for a
run that got as far as building the model, the placements of one routed-expert
weight and of the router gate as each rank holds them.

The placements come from ``record_placements``, a torchtitan config override
(``--override.imports tools.moe_layouts.record_placements={"dir": ...}``) that
swaps the recipe's checkpoint manager for a subclass which, when the trainer
builds it (after the model is parallelized, before step 1), writes every
parameter's mesh, placements and global and local shapes to
``<dir>/placements-rank<r>.json``. It reads the model only; training is
unchanged. A developer tool of the checkout, not part of the package.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.tensor import DTensor
from torchtitan.config import derive, override

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.validation.recipes import recipe_imports
from gefen_titan.validation.runs import imports_flag

ROOT = Path(__file__).resolve().parents[1]

# One row of the table: the layout, its number of ranks and the flags that make it.
@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    flags: tuple[str, ...]
    flavor: str | None = None  # another flavor than the recipe's


def _par(**degrees: int) -> tuple[str, ...]:
    names = {"dp_shard": "data_parallel_shard_degree", "dp_replicate": "data_parallel_replicate_degree",
             "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree", "ep": "expert_parallel_degree"}
    out: list[str] = []
    for key, value in degrees.items():
        out += [f"--parallelism.{names[key]}", str(value)]
    return tuple(out)


LAYOUTS = (
    Layout("FSDP 2 (EP 1)", 2, _par(dp_shard=2)),
    Layout("EP 2", 2, _par(dp_shard=2, ep=2)),
    Layout("TP 2 (EP 1)", 2, _par(dp_shard=1, tp=2)),
    Layout("EP 2 x TP 2 (2 ranks: EP over the TP ranks)", 2, _par(dp_shard=1, tp=2, ep=2)),
    Layout("PP 2 (EP 1)", 2, _par(dp_shard=1, pp=2)),
    Layout("FSDP 4 (EP 1)", 4, _par(dp_shard=4)),
    Layout("EP 2 x efsdp 2", 4, _par(dp_shard=4, ep=2)),
    Layout("EP 4", 4, _par(dp_shard=4, ep=4)),
    Layout("EP 2 x TP 2 (FSDP 2 x TP 2)", 4, _par(dp_shard=2, tp=2, ep=2)),
    Layout("PP 2 x FSDP 2 (EP 1)", 4, _par(dp_shard=2, pp=2)),
    Layout("PP 2 x EP 2", 4, _par(dp_shard=2, pp=2, ep=2)),
    Layout("HSDP 2 x 2 (EP 1)", 4, _par(dp_replicate=2, dp_shard=2)),
    Layout("HSDP 2 x 2 with EP 2", 4, _par(dp_replicate=2, dp_shard=2, ep=2)),
    # What torchtitan refuses (or where it breaks): the recipe's disable_cuda_graphs
    # taken back, EP wider than the ranks it borrows from, experts that EP cannot split evenly.
    Layout("EP 2 with CUDA graphs on", 2, _par(dp_shard=2, ep=2) + ("--training.no-disable-cuda-graphs",)),
    Layout("EP 4 on 2 ranks", 2, _par(dp_shard=2, ep=4)),
    Layout("EP 3 (8 experts)", 3, _par(dp_shard=3, ep=3)),
    Layout("EP 4 with 2 experts", 4, _par(dp_shard=4, ep=4), "debugmodel_moe_2e"),
)

# The flags every probe run gets: a few short steps, no checkpoint.
RUN_FLAGS = ("--training.steps", "3", "--training.local_batch_size", "2", "--training.seq_len", "64",
             "--checkpoint.enable", "false", "--metrics.log_freq", "1",
             "--parallelism.pipeline_parallel_schedule", "1F1B",
             "--parallelism.pipeline_parallel_microbatch_size", "1")

STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+(-?[0-9.eE+-]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
EXPERT_RE = re.compile(r"\.moe\.routed_experts\.inner_experts\.w1_EFD$")
GATE_RE = re.compile(r"\.moe\.router\.gate\.weight$")


# ------------------------------------------------------------------ the override (runs in the ranks)
def _describe(t: Any) -> dict[str, Any]:
    if isinstance(t, DTensor):
        return {"mesh": list(t.device_mesh.mesh_dim_names or ()), "mesh_shape": list(t.device_mesh.shape),
                "placements": [str(p) for p in t.placements], "shape": list(t.shape),
                "local_shape": list(t.to_local().shape)}
    return {"mesh": [], "mesh_shape": [], "placements": ["(plain tensor)"], "shape": list(t.shape),
            "local_shape": list(t.shape)}


class PlacementRecordingCheckpointManager(GefenCheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(GefenCheckpointManager.Config):
        placements_dir: str = ""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        rank = int(os.environ.get("RANK", "0"))
        out = {}
        for part in kwargs.get("model_parts", []):
            for fqn, p in part.named_parameters():
                out[fqn] = _describe(p)
            for fqn, b in part.named_buffers():
                if "expert_bias" in fqn or "tokens_per_expert" in fqn:
                    out[fqn] = _describe(b)
        os.makedirs(config.placements_dir, exist_ok=True)
        Path(config.placements_dir, f"placements-rank{rank}.json").write_text(json.dumps(out, indent=1))


@override(target=GefenCheckpointManager.Config, exact=True,
          description="tools.moe_layouts: record every parameter's placements at build")
def record_placements(cfg: GefenCheckpointManager.Config, *, dir: str):
    return derive(cfg, PlacementRecordingCheckpointManager.Config, placements_dir=dir)


# ------------------------------------------------------------------ the probe (the parent)
@dataclass
class Result:
    layout: Layout
    status: str  # "trains", "refused", "crashes", "timeout"
    detail: str
    losses: dict[int, float] = field(default_factory=dict)
    expert: tuple[str, dict[str, Any]] | None = None
    gate: tuple[str, dict[str, Any]] | None = None
    seconds: float = 0.0


def _first_error(log: str) -> str:
    """The line that says why a run stopped: the first ``...Error: ...`` line, else the log's last line."""
    lines = [ANSI_RE.sub("", line).rstrip() for line in log.splitlines()]
    for line in lines:
        m = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if m and "Warning" not in m.group(1):
            return f"{m.group(1)}: {m.group(2)}"
    return next((ln for ln in reversed(lines) if ln.strip()), "")


def _pick(placements: list[dict[str, Any]], pattern: re.Pattern[str]) -> tuple[str, dict[str, Any]] | None:
    for rank_map in placements:
        names = sorted((n for n in rank_map if pattern.search(n)), key=lambda n: [int(x) if x.isdigit() else x
                                                                                   for x in n.split(".")])
        if names:
            return names[0], rank_map[names[0]]
    return None


def probe(recipe: str, layout: Layout, out: Path, timeout: float) -> Result:
    folder = out / re.sub(r"[^a-z0-9]+", "_", layout.name.lower()).strip("_")
    folder.mkdir(parents=True, exist_ok=True)
    # The recipe's own overrides (a command-line --override.imports replaces them) and the recorder.
    imports = imports_flag([*recipe_imports(recipe), ["tools.moe_layouts.record_placements",
                                                       {"dir": str(folder / "placements")}]])
    flavor = ["--model.flavor", layout.flavor] if layout.flavor else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={layout.nproc}",
           str(ROOT / "train.py"), "--job.config", recipe, "--job.dump_folder", str(folder), *RUN_FLAGS,
           *layout.flags, *flavor, *imports]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    begin = time.monotonic()
    with open(folder / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    seconds = time.monotonic() - begin
    text = (folder / "train.log").read_text(errors="replace")
    losses: dict[int, float] = {}
    for step, loss in STEP_RE.findall(ANSI_RE.sub("", text)):
        if float(loss) >= 0:
            losses.setdefault(int(step), float(loss))
    placements = [json.loads(p.read_text()) for p in sorted((folder / "placements").glob("placements-rank*.json"),
                                                             key=lambda p: int(p.stem.rsplit("rank", 1)[1]))]
    if rc == 0 and losses:
        status, detail = "trains", " ".join(f"{losses[s]:.4f}" for s in sorted(losses))
    elif rc is None:
        status, detail = "timeout", f"no result in {timeout:.0f} s"
    else:
        # Refused: a config check said no before the model was built (no placements recorded).
        err = _first_error(text)
        refused = not placements and any(k in err for k in ("ValueError", "AssertionError", "RecipeError"))
        status, detail = ("refused" if refused else "crashes"), err
    return Result(layout, status, detail, losses, _pick(placements, EXPERT_RE), _pick(placements, GATE_RE), seconds)


def _fmt(entry: tuple[str, dict[str, Any]] | None) -> str:
    if entry is None:
        return "-"
    _, d = entry
    if not d["mesh"]:
        return "plain tensor"
    mesh = " x ".join(f"{n} {s}" for n, s in zip(d["mesh"], d["mesh_shape"], strict=True))
    return f"({', '.join(d['placements'])}) on ({mesh}), local {tuple(d['local_shape'])}"


def table(results: list[Result]) -> str:
    rows = ["| layout | ranks | result | routed expert `w1_EFD` | router gate |", "|---|---|---|---|---|"]
    for r in results:
        what = r.layout.name + (f" [{r.layout.flavor}]" if r.layout.flavor else "")
        detail = r.detail.replace("|", "\\|")
        rows.append(f"| {what} (`{' '.join(r.layout.flags)}`) | {r.layout.nproc} | {r.status}: {detail} "
                    f"| {_fmt(r.expert)} | {_fmt(r.gate)} |")
    return "\n".join(rows)
