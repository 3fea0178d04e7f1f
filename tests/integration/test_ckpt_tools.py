"""``gefen-titan ckpt inspect | verify | convert`` on real train.py checkpoints.

One chain of three train.py runs of the debug recipe (1 process, one LR
schedule of 5 steps) is shared by the Gefen/AdamW tests, and one 2-rank run
of the GefenMuon recipe (2 steps) by the GefenMuon tests; corruptions work
on copies:

1. Gefen, steps 1-4, a checkpoint every step (the uninterrupted Gefen run);
2. its step 2 converted ``--to adamw``, resumed by AdamW for steps 3-5 (the
   uninterrupted AdamW run from then on);
3. run 2's step 3 converted ``--to gefen``, resumed by Gefen for steps 4-5.

Each resume is compared with the run it continues: the first resumed loss
must be the same (model, data position and LR schedule are copied
unchanged), the next within a measured tolerance, and the first resumed
update (parameters after it minus before) close to the uninterrupted run's,
much closer than a resume with a fresh optimizer state gets.

4. ``recipes/llama_gefen_muon.toml`` on 2 ranks (FSDP2), steps 1-2: GefenMuon
   for the blocks' attention and feed-forward matrices, Gefen for the rest.
"""

import contextlib
import io
import json
import math
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import gefen_titan.train
from gefen_titan.checkpoint.format import schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools import cli
from gefen_titan.ckpt_tools.view import Checkpoint
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen_muon import keys as muon_keys
from tests.helpers import processes
from tests.helpers.bad_checkpoints import drop_entry, edited, set_entry

ROOT = Path(__file__).resolve().parents[2]
STEP_RE = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([0-9.]+)")
RECIPE = "recipes/llama_gefen_dp1.toml"
MUON_RECIPE = "recipes/llama_gefen_muon.toml"
MUON_PATTERN = re.compile(r"^layers\.\d+\.(attention|feed_forward)\.")  # the recipe's GefenMuon group
# The tests read and write checkpoints with DCP in this one process, as the tools do.
pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")


def train(dump: Path, *args: str, recipe: str = RECIPE, world: int = 1) -> dict[int, float]:
    """One train.py run of ``recipe`` on ``world`` rank(s) into ``dump``: its losses.

    train.py's main on each rank as torchrun starts it (one thread), by
    ``processes.run_ranks``: forked from the session's fork server where it
    can be, since what is tested here is the tools, and a fresh interpreter
    would cost each run ~7 s of imports.
    """
    argv = ["--job.config", recipe, "--job.dump_folder", str(dump), "--lr_scheduler.total_steps", "5",
            "--checkpoint.interval", "1", *args]
    log = processes.run_ranks(world, gefen_titan.train.main, argv, logs=dump / "logs", timeout=600)
    text = re.sub(r"\x1b\[[0-9;]*m", "", log)
    out: dict[int, float] = {}
    for step, loss in STEP_RE.findall(text):
        out.setdefault(int(step), float(loss))
    return out


def convert_json(*args) -> tuple[int, dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main([str(a) for a in args] + ["--json"])
    return rc, json.loads(buf.getvalue())


# The Gefen runs here keep the block second moment (their packed (magnitude, vmean) grids are what these
# tests read by hand); the factored default's entries through the same tools: tests/unit/test_factored_tools.py.
BLOCK = ("--optimizer.gefen.second_moment", "block")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt_tools")
    gefen = train(base / "gefen", "--training.steps", "4", *BLOCK)
    assert sorted(gefen) == [1, 2, 3, 4]
    to_adamw = convert_json("convert", step_dir(base, "gefen", 2), step_dir(base, "as_adamw", 2), "--to", "adamw")
    assert to_adamw[0] == 0, to_adamw
    as_adamw = train(base / "as_adamw", "--training.steps", "5", "--optimizer.name", "AdamW")
    to_gefen = convert_json("convert", step_dir(base, "as_adamw", 3), step_dir(base, "as_gefen", 3), "--to",
                            "gefen", "--max-tensor-parallel-degree", "2", "--second-moment", "block")
    assert to_gefen[0] == 0, to_gefen
    as_gefen = train(base / "as_gefen", "--training.steps", "5", *BLOCK)
    return {"base": base, "gefen": gefen, "as_adamw": as_adamw, "as_gefen": as_gefen,
            "to_adamw": to_adamw[1], "to_gefen": to_gefen[1]}


def step_dir(base: Path, run: str, step: int) -> Path:
    return base / run / "checkpoint" / f"step-{step}"


def ckpt(capsys, *args: str) -> tuple[int, str]:
    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().out


def ckpt_json(capsys, *args: str) -> tuple[int, dict]:
    rc, out = ckpt(capsys, *args, "--json")
    return rc, json.loads(out)


# ------------------------------------------------------------------ export
def _same(a, b, path="") -> list[str]:
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{path}: keys"]
        return [d for k in a for d in _same(a[k], b[k], f"{path}.{k}")]
    return [] if a == b else [path]


def test_export_writes_what_torch_load_reads_weights_only(runs, capsys, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gefen_titan.checkpoint.io import storage

    src = step_dir(runs["base"], "gefen", 4)
    # DCP's own tool cannot read format v3's raw entries: the reason for the command.
    # (DCP wraps the UnpicklingError in a CheckpointException, a BaseException.)
    with pytest.raises(BaseException, match="(?i)weights only load failed|unsupported operand"):
        dcp_to_torch_save(str(src), str(tmp_path / "dcp.pt"))
    out = tmp_path / "step-4.pt"
    rc, report = ckpt_json(capsys, "export", src, out)
    assert rc == 0 and report["ok"] and report["tensors"] > 0
    got = torch.load(out, weights_only=True)
    assert _same(storage.load_all(src), got) == []

    def tensors(v):
        return [v] if isinstance(v, torch.Tensor) else [t for x in v.values() for t in tensors(x)] \
            if isinstance(v, dict) else []

    assert any(t.dtype == torch.uint8 for t in tensors(got))  # Gefen's codes, from the raw entries
    rc, text = ckpt(capsys, "export", src, out)  # never over a file
    assert rc == 1 and not list(tmp_path.glob("*.partial-*"))


# ------------------------------------------------------------------ inspect
def test_inspect_gefen_checkpoint(runs, capsys):
    base = runs["base"]
    path = step_dir(base, "gefen", 2)
    rc, report = ckpt_json(capsys, "inspect", path)
    assert rc == 0
    assert report["format"] == {"name": "gefen-titan", "version": schema.VERSION, "blocking": "agreed"}
    assert report["counters"]["train_state.step"] == 2 and report["counters"]["lr_scheduler.last_epoch"] == 2
    assert report["mesh"]["writer_ranks"] == 1 and report["mesh"]["data_parallel_ranks"] == 1
    (opt,) = report["optimizers"]
    assert opt["kind"] == "Gefen" and opt["global_step"] == 2 and opt["deterministic"] is False
    # Against the checkpoint itself, read independently with DCP.
    md = Checkpoint(str(path)).metadata.state_dict_metadata
    rec_key = next(k for k in md if k.startswith("optimizer." + schema.PREFIX + "optimizer/"))
    values = {rec_key: ""}
    dcp.load(values, checkpoint_id=str(path), no_dist=True)
    record = json.loads(values[rec_key])
    assert [p["fqn"] for p in opt["params"]] == [p["fqn"] for p in record["params"]]
    for row, rec in zip(opt["params"], record["params"]):
        assert row["period"] == rec["period"] and row["step"] == rec["step"] == 2
        packed = tuple(md["optimizer." + gefen_keys.grid_key(row["fqn"])].size)
        grid = packed[:-1]
        assert packed[-1] == 2 and tuple(row["grid"]) == grid == tuple(rec["shape"][:-1]) + (
            rec["shape"][-1] // rec["period"],)
        assert row["bytes"] == math.prod(rec["shape"]) + 8 * math.prod(grid)
    assert opt["elements"] == sum(math.prod(p["shape"]) for p in record["params"])
    assert 1.0 < opt["stored_bytes_per_param"] < 1.2
    (cb,) = opt["codebooks"].values()
    assert cb["entries"] == 256 and cb["min"] == -1 and cb["max"] == 1 and cb["sorted"]
    # Every stored byte is some entry's: the entries' bytes add up to the files.
    assert report["total_bytes"] == sum(e.stored_bytes for e in Checkpoint(str(path)).entries.values())
    assert report["model"]["tensors"] == sum(
        1 for k in md if not k.startswith(("optimizer.", "dataloader.", "lr_scheduler.", "train_state.")))
    rc, text = ckpt(capsys, "inspect", path)
    assert rc == 0
    assert f"gefen-titan v{schema.VERSION} (agreed blocking)" in text
    assert re.search(r"tok_embeddings\.weight\s+2048x256\s+\d+\s+2048x\d+\s+2\s", text), text


def test_inspect_adamw_checkpoint_and_bad_paths(runs, capsys, tmp_path):
    base = runs["base"]
    rc, report = ckpt_json(capsys, "inspect", step_dir(base, "as_adamw", 3))
    assert rc == 0 and report["format"] is None
    (opt,) = report["optimizers"]
    assert opt["kind"] == "AdamW" and opt["steps"] == [3.0] and len(opt["params"]) == 45
    (group,) = opt["hyperparameters"]
    assert 0 < group["lr"] <= 2e-3 and group["betas"] == [0.9, 0.95] and group["weight_decay"] == 0.1  # lr: scheduled
    assert all(set(p["state"]) == {"exp_avg", "exp_avg_sq", "step"} for p in opt["params"])
    # The run folder instead of a step folder, and no folder at all: exit 1, no traceback.
    rc, out = ckpt(capsys, "inspect", base / "as_adamw" / "checkpoint")
    assert rc == 1
    rc, report = ckpt_json(capsys, "inspect", tmp_path / "nowhere")
    assert rc == 1 and "does not exist" in report["error"]


# ------------------------------------------------------------------ verify
def test_verify_sound_checkpoint_through_the_command(runs, capsys, monkeypatch):
    """``python -m gefen_titan ckpt verify`` (what the ``gefen-titan`` script runs), in this process."""
    import runpy

    path = step_dir(runs["base"], "gefen", 4)
    monkeypatch.setattr(sys, "argv", ["gefen-titan", "ckpt", "verify", str(path), "--json"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("gefen_titan", run_name="__main__")
    assert done.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["problems"] == []
    size = sum(p.stat().st_size for p in path.glob("*.distcp"))
    assert report["checked"]["bytes"] == size  # every byte of every data file read
    # Every framed item's CRC32, every item's digest (v3's raw entries have no framing, so no CRC32).
    raw = sum(schema.is_raw_entry(index.fqn) for index in Checkpoint(str(path)).metadata.storage_data)
    assert raw == 2 * 45
    assert report["checked"]["crc_checked"] == report["checked"]["items"] - raw
    assert report["checked"]["digests_checked"] == report["checked"]["items"]
    assert report["gefen"]["params"] == 45
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gefen-titan"] == "gefen_titan.cli:main" and scripts["gefen-titan-train"] == "gefen_titan.train:main"


@pytest.fixture
def copy(runs, tmp_path):
    """Copies of steps 3 and 4 of the Gefen run; the tests corrupt step 4."""
    base = runs["base"]
    for step in (3, 4):
        shutil.copytree(step_dir(base, "gefen", step), tmp_path / "checkpoint" / f"step-{step}")
    return tmp_path / "checkpoint" / "step-4"


def _item(path: Path, key: str):
    md = Checkpoint(str(path)).metadata
    return next(info for index, info in md.storage_data.items() if index.fqn == key)


def test_verify_truncated_file(copy, capsys):
    data = copy / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size * 2 // 3)
    rc, report = ckpt_json(capsys, "verify", copy)
    assert rc == 1 and not report["ok"]
    assert report["first_bad_file"] == "__0_0.distcp"
    first = report["problems"][0]
    assert "past the end of its file" in first["what"] and first["check"] == "items inside files", first
    assert "--checkpoint.load_step 3" in report["advice"]
    rc, text = ckpt(capsys, "verify", copy)
    assert rc == 1 and text.startswith("FAILED") and "first bad file: __0_0.distcp" in text


def test_verify_corrupted_record_bytes(copy, capsys):
    """One flipped byte inside the stored Gefen record: the CRC32 of its torch.save archive catches it."""
    key = "optimizer." + gefen_keys.optimizer_key("tok_embeddings.weight")
    info = _item(copy, key)
    with open(copy / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x20]))
    rc, report = ckpt_json(capsys, "verify", copy)
    assert rc == 1
    assert report["first_bad_file"] == info.relative_path
    assert any(p["entry"] == key and "CRC32" in p["what"] for p in report["problems"]), report["problems"]


def test_verify_inconsistent_records_and_non_finite_grid(copy, tmp_path, capsys):
    """A well-formed checkpoint with wrong content: a period its grid does not match, a NaN magnitude."""
    ck = Checkpoint(str(copy))
    sd = ck.load(list(ck.entries))
    key = "optimizer." + gefen_keys.optimizer_key("tok_embeddings.weight")
    record = json.loads(sd[key])
    wo = next(p for p in record["params"] if p["fqn"] == "layers.0.attention.wo.weight")
    wo["period"] = 64 if wo["period"] != 64 else 32
    sd[key] = json.dumps(record)
    sd["optimizer." + gefen_keys.grid_key("lm_head.weight")][3, 1, 0] = float("nan")
    bad = tmp_path / "bad" / "step-4"
    dcp.save(sd, checkpoint_id=str(bad), no_dist=True)
    rc, report = ckpt_json(capsys, "verify", bad)
    assert rc == 1
    whats = [p["what"] for p in report["problems"]]
    assert any("non-finite" in w for w in whats), whats
    assert any(gefen_keys.grid_key("layers.0.attention.wo.weight") in w and "expected" in w for w in whats), whats
    assert report["first_bad_file"] == "__0_0.distcp"


# ------------------------------------------------------------------ v1
def test_inspect_and_verify_format_v1(tmp_path, capsys):
    """A per-rank (v1) checkpoint written by the container itself, one process."""
    from gefen_titan.optim.blocking_options import BlockingOptions
    from gefen_titan.optim.container import GefenOptimizersContainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.LayerNorm(32))
    config = GefenOptimizersContainer.Config(name="Gefen", lr=1e-2, blocking=BlockingOptions(mode="per_rank"))
    opt = config.build(model_parts=[model])
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    path = tmp_path / "step-1"
    sd = {"optimizer": opt.state_dict(), **model.state_dict()}
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    rc, report = ckpt_json(capsys, "inspect", path)
    assert rc == 0 and report["format"]["version"] == 1 and report["format"]["blocking"] == "per_rank"
    (o,) = report["optimizers"]
    assert o["source_ranks"] == 1 and [p["fqn"] for p in o["params"]] == ["0.weight", "1.weight", "1.bias"]
    assert all(p["step"] == 1 and p["periods_by_rank"]["0"] >= 1 for p in o["params"])
    rc, report = ckpt_json(capsys, "verify", path)
    assert rc == 3 and report["ok"] and report["verdict"] == "unchecked", report  # v1 predates digests
    # Corrupt v1 blocks (a negative vmean) are found, and v1 does not convert.
    sd = Checkpoint(str(path)).load(list(Checkpoint(str(path)).entries))
    blocks = next(k for k in sd if "/blocks/" in k)
    sd[blocks][0, 1] = -1.0
    dcp.save(sd, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    rc, report = ckpt_json(capsys, "verify", tmp_path / "bad")
    assert rc == 1 and any(p["entry"] == blocks and "negative" in p["what"] for p in report["problems"])
    rc, report = ckpt_json(capsys, "convert", path, tmp_path / "out", "--to", "adamw")
    assert rc == 1 and "formats v2 to v4" in report["error"] and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ convert
def _model(path: Path) -> dict[str, torch.Tensor]:
    ck = Checkpoint(str(path))
    return ck.load([e.key for e in ck.entries.values() if e.component == "model"])


def update_error(ref: Path, run: Path, step: int) -> float:
    """Relative difference of the update of ``step`` (parameters after it minus before) between two runs."""
    before = _model(ref / "checkpoint" / f"step-{step - 1}")
    want, got = _model(ref / "checkpoint" / f"step-{step}"), _model(run / "checkpoint" / f"step-{step}")
    num = sum(float((got[k] - want[k]).double().square().sum()) for k in before)
    den = sum(float((want[k] - before[k]).double().square().sum()) for k in before)
    return math.sqrt(num / den)


def test_convert_gefen_to_adamw_resumes(runs, capsys):
    base, gefen, resumed, report = runs["base"], runs["gefen"], runs["as_adamw"], runs["to_adamw"]
    src, out = step_dir(base, "gefen", 2), step_dir(base, "as_adamw", 2)
    assert report["params"] == 45 and report["steps"] == {"2": 45}
    # exp_avg is codebook[code] * magnitude of its block, exp_avg_sq the block's vmean (computed here anew).
    fqn = "layers.0.feed_forward.w2.weight"
    keys = {k: "optimizer." + f(fqn) for k, f in (("codes", gefen_keys.qcodes_key), ("grid", gefen_keys.grid_key))}
    cb_key = "optimizer." + gefen_keys.codebook_key("tok_embeddings.weight")
    md = Checkpoint(str(src)).metadata.state_dict_metadata
    g = {k: torch.empty(md[k].size, dtype=md[k].properties.dtype) for k in [*keys.values(), cb_key]}
    dcp.load(g, storage_reader=storage.storage_reader(src), no_dist=True)  # raw entries: gefen-titan's reader
    mag, vmean = gefen_keys.unpack_blocks(schema.VERSION, {"grid": g[keys["grid"]]})
    a = {f"optimizer.state.{fqn}.{s}": torch.empty(md[keys["codes"]].size) for s in ("exp_avg", "exp_avg_sq")}
    a[f"optimizer.state.{fqn}.step"] = torch.empty(())
    dcp.load(a, checkpoint_id=str(out), no_dist=True)
    period = md[keys["codes"]].size[-1] // mag.shape[-1]
    mag = mag.repeat_interleave(period, dim=-1)
    assert torch.equal(a[f"optimizer.state.{fqn}.exp_avg"], g[cb_key][g[keys["codes"]].long()] * mag)
    assert torch.equal(a[f"optimizer.state.{fqn}.exp_avg_sq"], vmean.repeat_interleave(period, dim=-1))
    assert float(a[f"optimizer.state.{fqn}.step"]) == 2
    rc, _ = ckpt(capsys, "verify", out)
    assert rc == 0

    assert sorted(resumed) == [3, 4, 5]  # train.py resumed the converted step-2
    assert resumed[3] == gefen[3]  # same model, data position and LR: the same first loss
    # Measured: |loss 4 - Gefen's| 0.025 (AdamW resumed with a fresh state instead: 0.066);
    # the step-3 update is 0.31 off Gefen's, relative (fresh AdamW: 0.89). The rest is
    # AdamW itself: its new momentum unquantized, its new second moment per element.
    assert abs(resumed[4] - gefen[4]) < 0.045, (resumed, gefen)
    assert update_error(base / "gefen", base / "as_adamw", 3) < 0.5


def test_convert_adamw_to_gefen_resumes(runs, capsys):
    base, adamw, resumed, report = runs["base"], runs["as_adamw"], runs["as_gefen"], runs["to_gefen"]
    out = step_dir(base, "as_gefen", 3)
    assert report["params"] == 45 and report["steps"] == {"3": 45}
    assert report["momentum_relative_rms_error"] < 0.02
    assert 1.0 < report["state_bytes_per_param"] < 1.2
    rc, inspected = ckpt_json(capsys, "inspect", out)
    assert rc == 0 and inspected["format"]["version"] == schema.VERSION
    (opt,) = inspected["optimizers"]
    periods = {p["fqn"]: p["period"] for p in opt["params"]}
    assert periods["norm.weight"] == 1 and all(
        p["shape"][-1] % (2 * p["period"]) == 0 for p in opt["params"] if len(p["shape"]) == 2)  # TP 2 cuts
    rc, _ = ckpt(capsys, "verify", out)
    assert rc == 0

    assert sorted(resumed) == [4, 5]
    assert resumed[4] == adamw[4]
    # Measured: |loss 5 - AdamW's| 0.019 (Gefen resumed with a fresh state instead: 0.159);
    # the step-4 update is 0.34 off AdamW's, relative (fresh Gefen: 1.36): Gefen's 8-bit
    # momentum and block second moment against AdamW's per-element fp32 state.
    assert abs(resumed[5] - adamw[5]) < 0.08, (resumed, adamw)
    assert update_error(base / "as_adamw", base / "as_gefen", 4) < 0.7


def test_convert_refuses_what_it_cannot_do(runs, capsys, tmp_path):
    base = runs["base"]
    gefen, adamw = step_dir(base, "gefen", 2), step_dir(base, "as_adamw", 3)
    rc, report = ckpt_json(capsys, "convert", gefen, tmp_path / "a", "--to", "gefen")
    assert rc == 1 and "already holds Gefen state" in report["error"]
    rc, report = ckpt_json(capsys, "convert", adamw, tmp_path / "b", "--to", "adamw")
    assert rc == 1 and "holds no Gefen state" in report["error"]
    rc, report = ckpt_json(capsys, "convert", adamw, step_dir(base, "as_adamw", 4), "--to", "gefen")
    assert rc == 1 and "exists" in report["error"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not list(tmp_path.glob("*.partial-*"))


def test_to_gefen_refuses_adam_variants_gefen_cannot_represent():
    from gefen_titan.ckpt_tools.convert_to_gefen import _gefen_group
    from gefen_titan.ckpt_tools.view import CkptError

    adamw = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "maximize": False, "decoupled_weight_decay": True}
    assert _gefen_group("w", adamw) == {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    assert _gefen_group("w", {**adamw, "decoupled_weight_decay": False, "weight_decay": 0.0})["weight_decay"] == 0
    for bad, match in (({"amsgrad": True}, "amsgrad"), ({"maximize": True}, "maximize"),
                       ({"decoupled_weight_decay": False}, "coupled"), ({"betas": (1.0, 0.95)}, "represented")):
        with pytest.raises(CkptError, match=match):
            _gefen_group("w", {**adamw, **bad})


# ------------------------------------------------------------------ GefenMuon
@pytest.fixture(scope="module")
def muon(tmp_path_factory):
    """Step 2 of a 2-rank GefenMuon + Gefen run; its folder is ``ckpt`` (what ``bad_checkpoints.edited`` reads)."""
    base = tmp_path_factory.mktemp("ckpt_tools_muon")
    losses = train(base / "muon", "--training.steps", "2", "--checkpoint.folder", "ckpt", recipe=MUON_RECIPE,
                   world=2)
    assert sorted(losses) == [1, 2]
    return base / "muon"


def _muon_path(root: Path) -> Path:
    return root / "ckpt" / "step-2"


def test_inspect_gefen_muon_checkpoint(muon, capsys):
    path = _muon_path(muon)
    rc, report = ckpt_json(capsys, "inspect", path)
    assert rc == 0 and report["format"]["version"] == schema.VERSION
    assert report["mesh"]["writer_ranks"] == 2 and report["mesh"]["data_parallel_ranks"] == 2
    gefen, gm = report["optimizers"]
    assert gefen["kind"] == "Gefen" and gm["kind"] == "GefenMuon"
    assert not any(MUON_PATTERN.match(p["fqn"]) for p in gefen["params"])
    assert len(gm["params"]) == 30 and all(MUON_PATTERN.match(p["fqn"]) for p in gm["params"])
    assert gm["global_step"] == 2 and gm["deterministic"] is False
    (group,) = gm["hyperparameters"]
    assert {k: group[k] for k in ("momentum", "nesterov", "ns_steps", "adjust_lr_fn", "normuon")} == {
        "momentum": 0.95, "nesterov": True, "ns_steps": 5, "adjust_lr_fn": "match_rms_adamw", "normuon": True}
    (cb,) = gm["codebooks"].values()
    assert cb["entries"] == 256 and cb["min"] == -1 and cb["max"] == 1 and cb["sorted"]
    # Against the checkpoint itself, read independently with DCP.
    md = Checkpoint(str(path)).metadata.state_dict_metadata
    (rec_key,) = [k for k in md if k.startswith("optimizer." + schema.PREFIX + "muon/")]
    values = {rec_key: ""}
    dcp.load(values, checkpoint_id=str(path), no_dist=True)
    record = json.loads(values[rec_key])
    assert record["kind"] == "GefenMuon" and [p["fqn"] for p in gm["params"]] == [p["fqn"] for p in record["params"]]
    for row, rec in zip(gm["params"], record["params"]):
        keys = {k: "optimizer." + v for k, v in muon_keys.muon_tensor_keys(row["fqn"]).items()}
        assert row["period"] == rec["period"] > 0 and row["step"] == row["rows_step"] == 2
        grid = tuple(md[keys["magnitude"]].size)
        assert tuple(row["grid"]) == grid == tuple(rec["shape"][:-1]) + (rec["shape"][-1] // rec["period"],)
        assert tuple(md[keys["rows"]].size) == (rec["shape"][0],)
        assert row["bytes"] == math.prod(rec["shape"]) + 4 * math.prod(grid) + 4 * rec["shape"][0]
        assert row["cuts"] == [2, 1]  # FSDP2 over 2 ranks: two row shards
    # The totals count both kinds: every parameter has state, about one byte each.
    totals = report["optimizer_totals"]
    assert totals["kinds"] == ["Gefen", "GefenMuon"] and totals["params"] == 45
    assert totals["elements"] == gefen["elements"] + gm["elements"] == report["model"]["elements"]
    assert 1.0 < gm["stored_bytes_per_param"] < 1.2 and 1.0 < totals["stored_bytes_per_param"] < 1.2
    rc, text = ckpt(capsys, "inspect", path)
    assert rc == 0
    rec_name = muon_keys.muon_optimizer_key(record["params"][0]["fqn"])
    assert f"optimizer   GefenMuon (records {rec_name}): 30 parameters, global step 2" in text
    assert "momentum 0.95  nesterov True  ns_steps 5  adjust_lr_fn match_rms_adamw  normuon True" in text
    assert re.search(r"layers\.0\.attention\.wo\.weight\s+256x256\s+\d+\s+256x\d+\s+2\s+2\s+[\d,]+\s+2x1", text), text
    assert re.search(r"optimizers  Gefen \+ GefenMuon: 45 parameters, .* = 1\.\d+ bytes/param", text), text


def test_verify_gefen_muon_checkpoint(muon, capsys):
    rc, report = ckpt_json(capsys, "verify", _muon_path(muon))
    assert rc == 0 and report["ok"], report["problems"]
    assert report["gefen"]["params"] == 15
    assert report["gefen_muon"] == {"version": schema.VERSION, "optimizers": 1, "params": 30, "stateful_params": 30,
                                    "codebooks": 1}
    rc, text = ckpt(capsys, "verify", _muon_path(muon))
    assert rc == 0 and f"GefenMuon v{schema.VERSION}: 30 parameters in 1 record(s), 1 codebook(s)" in text


def _bad_group(opt_id: str):
    def ns_steps_zero(raw: str) -> str:
        record = json.loads(raw)
        record["params"][-1]["group"]["ns_steps"] = 0
        return json.dumps(record)
    return set_entry(muon_keys.muon_optimizer_key(opt_id), ns_steps_zero)


def test_verify_damaged_gefen_muon_state(muon, tmp_path, capsys):
    """Each damage alone fails verify, with a problem naming the damaged entry."""
    fqn = "layers.1.feed_forward.w2.weight"
    keys = muon_keys.muon_tensor_keys(fqn)
    opt_id = next(k.name for n in Checkpoint(str(_muon_path(muon))).optimizer
                  if (k := schema.parse_key(n)) and k.kind == "muon")
    cases = {
        "nan_magnitude": (set_entry(keys["magnitude"], lambda v: v.index_fill(0, torch.tensor([5]), float("nan"))),
                          "optimizer." + keys["magnitude"], "non-finite"),
        "negative_rows": (set_entry(keys["rows"], lambda v: -1 - v.abs()), "optimizer." + keys["rows"], "negative"),
        "no_rows": (drop_entry(keys["rows"]), keys["rows"], "missing"),
        "bad_group": (_bad_group(opt_id), "optimizer." + muon_keys.muon_optimizer_key(opt_id), "ns_steps=0"),
    }
    for name, (edit, entry, what) in cases.items():
        root = tmp_path / name
        edited(muon, root, 2, edit)
        rc, report = ckpt_json(capsys, "verify", _muon_path(root))
        assert rc == 1 and not report["ok"], name
        hits = [p for p in report["problems"] if entry in (p["entry"] or "") + p["what"] and what in p["what"]]
        assert hits, (name, report["problems"])
        if name == "no_rows":  # the table names it too
            rc, text = ckpt(capsys, "verify", _muon_path(root))
            assert rc == 1 and text.startswith("FAILED") and entry in text, text


def test_convert_refuses_gefen_muon(muon, tmp_path, capsys):
    """Both directions refuse before anything is written: GefenMuon's momentum has no AdamW equivalent."""
    for to in ("adamw", "gefen"):
        rc, report = ckpt_json(capsys, "convert", _muon_path(muon), tmp_path / to / "step-2", "--to", to)
        assert rc == 1, report
        error = report["error"]
        assert "convert handles Gefen <-> AdamW" in error and "GefenMuon state for 30 parameters" in error, error
        assert 'exclude_from_loading = ["optimizer"]' in error and "Nothing was written" in error, error
        assert not (tmp_path / to).exists()
    assert not list(tmp_path.rglob("*partial*"))
