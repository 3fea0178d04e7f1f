"""``[optimizer] name = "GefenMuonHybrid"`` end to end on CPU (gloo), through
``train.py`` and torchtitan's trainer and checkpointer.

* ``recipes/llama_gefen_muon_hybrid.toml`` saved at 2 ranks and resumed at 3
  by ``gefen-titan validate`` (its checks: every checkpoint entry, parameter,
  period, codebook, counter and group key after the load equal the save's;
  the losses within the validation's band): 3 launches; ``gefen-titan ckpt
  inspect`` names the checkpoint's GefenMuon and Gefen records.
* ``recipes/llama_gefen.toml --optimizer.name GefenMuonHybrid
  --optimizer.backup_optimizer adamw`` trains 2 steps and saves; the same
  command with the default backup (Gefen) is refused on every rank, naming
  the setting; the AdamW command resumes and trains step 3: 3 launches.

* ``llama_gefen_fsdp_tp.toml --optimizer.name GefenMuonHybrid`` built on the
  meta device at 4 fake ranks (TP-parallelized Linears route as plain ones).

(The recipe's own 7-step curve is tests/integration/test_recipe_regression.py's.)
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import processes

ROOT = Path(__file__).resolve().parents[2]
STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([0-9.]+)")
SPLIT_RE = re.compile(r"Optimizer (\w+) \(model_part=0\): (\d+) params")


def losses(log: str) -> dict[int, float]:
    out = {}
    for step, loss in STEP_RE.findall(re.sub(r"\x1b\[[0-9;]*m", "", log)):
        out.setdefault(int(step), float(loss))
    return out


def test_hybrid_recipe_saved_at_2_resumes_at_3(tmp_path, capsys):
    out = tmp_path / "validate"
    cmd = [sys.executable, "-m", "gefen_titan", "validate", "--recipe", "recipes/llama_gefen_muon_hybrid.toml",
           "--pairs", "2:3", "--backend", "gloo", "--no-dropped-state", "--steps-before", "2", "--steps-after", "1",
           "--global-batch", "6", "--local-batch", "1", "--out", str(out),
           *processes.validate_launcher()]
    proc = processes.run(cmd, cwd=ROOT, timeout=850)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "all pairs within tolerance" in proc.stdout
    (pair,) = json.loads((out / "report.json").read_text())["pairs"]
    assert pair["pair"] == "2->3" and pair["failures"] == []
    st = pair["state"]
    assert st["exact"] and st["params_exact"] and not st["problems"] and st["entries_differ"] == [], st
    assert sorted(int(s) for s in pair["resumed_losses"]) == [3]
    # The checkpoint is GefenMuon's and Gefen's records, as gefen-titan ckpt inspect names them.
    from gefen_titan.ckpt_tools import cli

    capsys.readouterr()
    assert cli.main(["inspect", str(out / "ref-2" / "checkpoint" / "step-2"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    gefen, muon = report["optimizers"]
    assert (gefen["kind"], muon["kind"]) == ("Gefen", "GefenMuon") and len(muon["params"]) == 30
    (group,) = muon["hyperparameters"]
    assert group["ns_steps"] == 3 and group["normuon"] is True  # tuned3
    assert report["optimizer_totals"]["params"] == 45


@pytest.fixture(scope="module")
def adamw_backup(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hybrid_adamw")
    common = ["--job.config", "recipes/llama_gefen.toml", "--optimizer.name", "GefenMuonHybrid",
              "--job.dump_folder", str(dump), "--checkpoint.interval", "2", "--training.local_batch_size", "2"]
    adamw = ["--optimizer.backup_optimizer", "adamw"]
    runs = {}
    from gefen_titan.train import main

    for name, args in (("first", [*adamw, "--training.steps", "2"]), ("gefen", ["--training.steps", "3"]),
                       ("resumed", [*adamw, "--training.steps", "3"])):
        # Forked ranks (processes.run_ranks): three launches without torchrun's imports each.
        try:
            runs[name] = (0, processes.run_ranks(2, main, [*common, *args], logs=dump / f"logs-{name}", timeout=600))
        except RuntimeError as e:  # a rank failed: its output is in the message
            runs[name] = (1, str(e))
    return dump, runs


def test_adamw_backup_trains_with_the_routed_split(adamw_backup):
    _, runs = adamw_backup
    rc, log = runs["first"]
    assert rc == 0, log[-4000:]
    assert sorted(losses(log)) == [1, 2]
    # torchtitan's own log of the groups: 30 hidden matrices, 15 others (embedding, norms, head).
    assert sorted(set(SPLIT_RE.findall(log))) == [("AdamW", "15"), ("ShardedGefenMuon", "30")]


def test_a_gefen_backup_resume_of_an_adamw_backup_checkpoint_is_refused_naming_the_setting(adamw_backup):
    _, runs = adamw_backup
    rc, log = runs["gefen"]
    assert rc != 0
    assert "GefenCheckpointError" in log and "were saved by AdamW and the recipe gives them to Gefen" in log
    assert 'set optimizer.hybrid.backup_optimizer = "adamw" (--optimizer.hybrid.backup_optimizer adamw)' in log
    assert not losses(log)  # refused before any step


def test_adamw_backup_resumes(adamw_backup):
    dump, runs = adamw_backup
    rc, log = runs["resumed"]
    assert rc == 0, log[-4000:]
    assert "Loading step 2 from " in log  # the manager's load line (checkpoint/log_lines.py)
    assert sorted(losses(log)) == [3]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2", "step-3"]


def test_fsdp_tp_model_routes_alike_on_meta():
    """``llama_gefen_fsdp_tp.toml --optimizer.name GefenMuonHybrid`` built as the
    Trainer builds it (torchtitan's parallelize: TP 2 × FSDP 2, DTensor
    parameters of parallelized Linears) on the meta device at 4 fake ranks,
    in a fresh process (``test_recipe_regression``'s builder)."""
    cmd = [sys.executable, "-m", "tests.integration.test_recipe_regression", "--build",
           "recipes/llama_gefen_fsdp_tp.toml", "4", json.dumps({"optimizer": {"name": "GefenMuonHybrid"}})]
    proc = processes.run(cmd, cwd=ROOT, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert built["optimizers"] == ["ShardedGefenMuon", "Gefen"]
    assert built["params"] == 45 and built["gefen_params"] == 15  # 30 matrices to GefenMuon, as on one rank
    assert len(built["placements"]) > 1 and built["mesh_sizes"] == [4]  # TP placements beside FSDP's
