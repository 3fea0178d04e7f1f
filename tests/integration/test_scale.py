"""The scale tools: scripts/gpu_check.sh's CPU path, the scale plan, the benchmarks' arguments.

* ``gpu_check.sh`` without CUDA: bad arguments exit 2 with the reason (its
  parser); a run does the CPU half of the checkpoint check (a real v3 checkpoint of the
  debug recipe at 2 gloo ranks), skips every GPU stage, writes its report
  and exits 3 saying "no CUDA".
* The scale plan against that real checkpoint (``tests/helpers/scale_worker.py``):
  the same DCP entries, chunks, bytes per rank file and writer of each
  replicated entry, exactly, and the metadata size within 0.5%; its
  first-step collectives are the ones real Gefen makes (recorded under a
  fake process group); the layer extrapolation of the metadata within 0.5%
  of the full build; one parameter's chunks and state by hand.
* Gefen's state formula against real stepped Gefen; the growth flags on
  hand-checkable series; the benchmarks' argument checks and targets.
* The MoE plan (``benchmarks/scale_moe.py``), in the same worker: against a
  real format-v3 checkpoint and the real optimizers' state at EP 2 x efsdp 2
  on 4 gloo ranks (``tests/helpers/scale_moe_job.py``, whole experts and
  rows cut by ``Shard(1)``), to the byte per rank; its GefenMuon matrices
  and schedule against the real GefenMuonHybrid's on torchtitan's
  DeepSeek-V3 debug model at EP 2 x efsdp 2 and EP 4 x efsdp 4; the
  metadata's extrapolation over dense and MoE layers; chunks and DistMuon's
  expert split by hand.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import checkpoint as bench_ckpt
from benchmarks import scale
from benchmarks import training as bench_train
from benchmarks.gpu_check import NO_CUDA
from tests.helpers import processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check_cpu(tmp_path_factory):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: gpu_check.sh runs its GPU stages there (not a CI check)")
    work = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = processes.run([str(ROOT / "scripts" / "gpu_check.sh"), "--work", str(work), "--out", str(work / "r.json")],
                         cwd=ROOT, env=env, timeout=600)
    return proc, work


def test_gpu_check_refuses_bad_arguments(capsys):
    from benchmarks import gpu_check

    for bad, why in ((["--stages", "kernels,warp"], "--stages: unknown warp"), (["--sizes", "64Q"], "--sizes"),
                     (["--train-steps", "1"], "--train-steps must be >= 2")):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(bad)
        assert e.value.code == 2 and why in capsys.readouterr().err
    args = gpu_check.parse_args(["--stages", "checkpoint,kernels", "--sizes", "1M,2G"])
    assert args.stages == ["checkpoint", "kernels"] and args.sizes == [1 << 20, 2 << 30]


def test_gpu_check_without_cuda_runs_the_cpu_half_and_says_so(gpu_check_cpu):
    proc, work = gpu_check_cpu
    assert proc.returncode == NO_CUDA, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA device" in proc.stdout
    report = json.loads((work / "r.json").read_text())
    assert report["status"] == "no_cuda" and report["env"]["cuda"] is False
    for stage in ("kernels", "bandwidth", "train", "converters"):
        assert report["stages"][stage] == {"ok": None, "skipped": "no CUDA"}
    ckpt = report["stages"]["checkpoint"]
    assert ckpt["ok"] is True and ckpt["gpu_half"] == "skipped: no CUDA"
    assert Path(ckpt["cpu_half"]["checkpoint"], ".metadata").is_file() and ckpt["cpu_half"]["entries"] > 0
    muon = report["stages"]["muon"]
    assert muon["ok"] is True and muon["cpu"]["shards_equal_whole"] and muon["gpu_half"] == "skipped: no CUDA"


@pytest.fixture(scope="module")
def moe_job(tmp_path_factory):
    from tests.helpers import scale_moe_job

    out = tmp_path_factory.mktemp("scale_moe")
    processes.run_ranks(4, scale_moe_job.main, ["--out", str(out)], logs=out / "logs", timeout=600)
    return out


@pytest.fixture(scope="module")
def worker(gpu_check_cpu, moe_job):
    _, work = gpu_check_cpu
    step_dir = json.loads((work / "r.json").read_text())["stages"]["checkpoint"]["cpu_half"]["checkpoint"]
    proc = processes.run([sys.executable, "-m", "tests.helpers.scale_worker", step_dir, str(moe_job)], cwd=ROOT,
                         timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_plan_matches_a_real_checkpoint(worker):
    c = worker["checkpoint"]
    assert c["keys_plan"] == c["keys_real"] and len(c["keys_plan"]) > 90  # v3: 2 per parameter, 3 shared
    assert c["chunks_plan"] == c["chunks_real"]
    assert c["files_plan"] == c["files_real"]  # bytes each rank wrote, to the byte
    # Replicated on FSDP: format, record, codebook, and each factored matrix's columns (the default).
    columns = sum("gefen/vcol/" in k for k in c["keys_real"])
    assert columns > 0 and c["replicated"] == 3 + columns and c["writers_plan"] == c["writers_real"]
    assert abs(c["metadata_plan"] - c["metadata_real"]) <= 0.005 * c["metadata_real"]


def test_plan_collectives_are_the_ones_gefen_makes(worker):
    c = worker["collectives"]
    assert c["width"] > 0 and [tuple(r) for r in c["recorded"]] == [tuple(e) for e in c["expected"]]


def test_metadata_extrapolation_is_close_to_the_full_build(worker):
    for name, e in worker["extrapolation"].items():
        assert e["full"]["exact"] and not e["layered"]["exact"]
        assert abs(e["layered"]["metadata"] - e["full"]["metadata"]) <= 0.005 * e["full"]["metadata"], name


def test_plan_by_hand(worker):
    h = worker["hand"]
    # (2048, 256) embedding, FSDP 2: rows 0-1023 and 1024-2047. Row unit: gcd(256, TP 2's cut at 128) = 128.
    assert h["shape"] == [2048, 256] and h["unit"] == 128 and h["fallback"] == 128 and h["finest"] == 8
    assert h["chunks"] == [[[1024, 256], [0, 0]], [[1024, 256], [1024, 0]]]
    # The default (factored): codes; a magnitude per block; an fp32 per local row and per (whole) column.
    assert h["state"] == 1024 * 256 + 4 * (1024 * 256 // 128) + 4 * 1024 + 4 * 256
    # Block: codes; magnitude, vmean, 2 scratch fp32 per block.
    assert h["state_block"] == 1024 * 256 + 16 * (1024 * 256 // 128)


def test_plan_schedules_gefen_muon_as_the_real_step_does(worker):
    got = worker["muon"]
    assert got["optimizers"] == 1 and got["planned"], got
    assert got["planned"] == got["real"]  # fqn, shape, ns_steps, members, shard numel and rows
    assert got["planned_schedule"] == got["real_schedule"]
    members = {tuple(m[3]) for m in got["real"]}
    assert members == {(0, 1)} and len({o for _, owners in got["real_schedule"] for o in owners}) == 2


def test_moe_plan_matches_a_real_expert_parallel_checkpoint(worker):
    for tag, placements in (("e4", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
                            ("e2", "(Shard(dim=1), Shard(dim=0))")):
        m = worker["moe_checkpoint"][tag]
        assert m["placements"] == placements  # whole experts on efsdp; rows cut (efsdp x EP > experts)
        c = m["checkpoint"]
        assert c["keys_plan"] == c["keys_real"] and c["chunks_plan"] == c["chunks_real"], tag
        assert c["files_plan"] == c["files_real"] and len(c["files_real"]) == 4, tag  # bytes per rank, exactly
        assert c["replicated"] >= 3 and c["writers_plan"] == c["writers_real"], tag
        assert abs(c["metadata_plan"] - c["metadata_real"]) <= 0.005 * c["metadata_real"], tag


def test_moe_state_per_rank_matches_the_real_optimizers(worker):
    for tag, m in worker["moe_checkpoint"].items():
        assert m["periods_agree"], tag
        assert m["gefen_plan"] == m["gefen_real"], tag  # Gefen on every parameter, each rank's bytes
        assert m["hybrid_plan"] == m["hybrid_real"], tag  # GefenMuon (NorMuon rows) + Gefen, placeholders
    assert len(set(worker["moe_checkpoint"]["e2"]["gefen_real"])) > 1  # uneven ranks: the per-rank split counts


def test_moe_plan_schedules_gefen_muon_as_the_real_step_does(worker):
    for mesh in ("4x2", "16x4"):
        got = worker["moe_muon"][mesh]
        assert got["optimizers"] == 1 and got["planned"], mesh
        assert got["planned"] == got["real"], mesh  # fqn, shape, ns_steps, members, shard numel and rows, param
        assert got["planned_schedule"] == got["real_schedule"], mesh
        experts = [m for m in got["real"] if m[6]]
        assert len(experts) == 5 * 3 * 8, mesh  # 5 MoE layers x w1/w2/w3 x 8 experts
    whole = [m for m in worker["moe_muon"]["4x2"]["real"] if m[6]]
    assert all(len(m[3]) == 1 for m in whole)  # EP 2 x efsdp 2: each expert on its one holder, no exchange
    assert len(worker["moe_muon"]["4x2"]["real_schedule"]) > 1  # buckets end between grouped weights
    cut = [m for m in worker["moe_muon"]["16x4"]["real"] if m[6]]
    # EP 4 x efsdp 4 (rank 4i + j): expert e's rows on the 4 efsdp ranks of EP rank e // 2, 64 rows each
    for m in cut:
        e = int(m[0].rsplit("[", 1)[1][:-1])
        assert list(m[3]) == [4 * i + e // 2 for i in range(4)] and list(m[5]) == [64] * 4, m[0]


def test_moe_metadata_extrapolation_over_dense_and_moe_layers(worker):
    got = worker["moe_muon"]["16x4"]
    assert got["kinds"] == [[0], [1, 2, 3, 4, 5]]  # DeepSeek-V3: its dense first layer, then MoE layers
    for name, e in got["extrapolation"].items():
        assert e["full"]["exact"] and not e["layered"]["exact"]
        assert abs(e["layered"]["metadata"] - e["full"]["metadata"]) <= 0.005 * e["full"]["metadata"], name


def test_moe_expert_chunks_and_distmuons_split_by_hand(worker):
    # DeepSeek-V3 debug: w1 (8 experts, 256, 256). EP 2 x efsdp 2, rank 2i + j: EP's Shard(0) gives EP rank j
    # experts 4j..4j+3, efsdp's (strided) Shard(0) gives efsdp rank i two of them.
    small = worker["moe_muon"]["4x2"]
    assert small["w1"]["chunks"] == [[[2, 256, 256], [4 * j + 2 * i, 0, 0]] for i in range(2) for j in range(2)]
    # EP 4 x efsdp 4, rank 4i + j: experts 2j, 2j+1, rows 64i..64i+63 (Shard(1): efsdp x EP = 16 > 8 experts).
    big = worker["moe_muon"]["16x4"]
    assert big["w1"]["chunks"] == [[[2, 64, 256], [2 * j, 64 * i, 0]] for i in range(4) for j in range(4)]
    # DistMuon computes whole experts by dim 0: EP 2 x efsdp 2, 2 per weight per rank (15 weights); EP 4 x
    # efsdp 4, EP rank j's 2 experts over 4 efsdp ranks: 1 on two of them, none on the other two.
    assert small["distmuon"] == {"busiest_experts": 30, "idle_expert_ranks": 0, "max_experts": 30}
    assert big["distmuon"] == {"busiest_experts": 15, "idle_expert_ranks": 8, "max_experts": 15}


def test_moe_plan_arguments():
    args = scale.parse_args(["--moe"])
    assert args.flavors == list(scale.MOE_DEFAULT) and args.meshes == ["ep"] and args.ep == [8, 64]
    assert args.worlds == list(scale.MOE_WORLDS)
    small = scale.parse_args([])  # without flags, a plan that finishes in minutes
    assert (small.flavors, small.meshes, small.worlds) == ([*scale.SMALL["flavors"]], [*scale.SMALL["meshes"]],
                                                           [*scale.SMALL["worlds"]]) and small.defaulted
    full = scale.parse_args(["--full"])
    assert (full.flavors, full.meshes, full.worlds) == (list(scale.FLAVORS), list(scale.MESHES), list(scale.WORLDS))
    with pytest.raises(SystemExit):
        scale.parse_args(["--full", "--moe"])
    with pytest.raises(SystemExit):
        scale.parse_args(["--flavors", "8B", "--meshes", "ep"])  # no experts
    with pytest.raises(SystemExit):
        scale.parse_args(["--moe", "--ep", "8,x"])
    with pytest.raises(ValueError, match="multiple of EP"):
        scale.mesh_for("ep", 12, ep=8)
    mesh = scale.mesh_for("ep", 1024, ep=8)
    assert mesh.label == "EP 8 x efsdp 128" and mesh.name == "ep8"
    assert mesh.parallelism()["expert_parallel_degree"] == 8
    assert "expert_parallel_degree" not in scale.mesh_for("fsdp", 8).parallelism()  # dense builds as before


def test_moe_plan_recipes_load_with_their_flavors():
    from gefen_titan.recipe.build import load_recipe

    for name, (recipe, flavor) in scale.MOE_FLAVORS.items():
        config = load_recipe(str(ROOT / recipe), {"model": {"flavor": flavor}}, world_size=64).config
        assert config.parallelism.expert_parallel_degree == 8 and config.training.disable_cuda_graphs, name
        assert config.model_spec.flavor == flavor and config.optimizer.name == "Gefen", name


def test_distmuon_does_not_apply_to_a_matrix_cut_over_two_mesh_dims():
    from torch.distributed.tensor import Shard

    from benchmarks import scale_moe

    # FSDP 2 x TP 2: DistMuon's owned transport moves a matrix along one mesh dim only.
    p = scale.Param("w", (8, 8), None, (Shard(0), Shard(1)), (2, 2), [(0, 0), (0, 1), (1, 0), (1, 1)], 8, [8])
    built = scale.Built("x", scale.mesh_for("fsdp_tp", 4, tp=2), 64, [p], "", [], {}, True, muon_fqns=frozenset({"w"}))
    got = scale_moe.distmuon_plan(built, [])
    assert not got["applies"] and "2 mesh dims" in got["why"]


def test_state_formula_matches_real_gefen(gefen_stepped):
    from gefen_titan.optim import gefenx as gx
    from gefen_titan.optim import registry

    _, opt, _ = gefen_stepped
    cost = registry.get("Gefen").cost  # the rule the plan's state_bytes reads
    total = 0
    for optim in opt.optimizers_of("Gefen"):
        total += cost.optimizer_bytes
        for _, p, _ in gx.named_params(optim):
            total += cost.param_bytes(tuple(p.shape), gx.period(optim, p), p.element_size())
    assert total == opt.state_bytes()[0]


def _rows(per_rank, world_sizes=(8, 16, 32, 64)):
    """Rows in the plan's layout where every figure is per_rank(W) on every rank."""
    rows = []
    for w in world_sizes:
        v = per_rank(w)
        side = {"written_max": v, "written_total": v * w, "items_max": v, "chunks": v * w, "metadata": v,
                "gathered": v}  # one rank's receive
        rows.append({"flavor": "x", "mesh": "fsdp", "world": w, "gefen_state": v, "adamw_state": v,
                     "agreement_per_rank": v, "gefen": side, "adamw": dict(side)})
    return rows


def test_growth_flags_by_hand():
    assert scale.slope({8: 1.0, 16: 2.0, 32: 4.0}) == pytest.approx(1.0)
    assert scale.slope({8: 64.0, 16: 16.0, 32: 4.0}) == pytest.approx(-2.0)
    shrinking = {f["figure"]: f for f in scale.flags(_rows(lambda w: 1024 / w))}
    flat = {f["figure"]: f for f in scale.flags(_rows(lambda w: 5.0))}
    growing = {f["figure"]: f for f in scale.flags(_rows(lambda w: 3.0 * w))}
    # Per-rank ~ 1/W: the job total is constant. Per-rank constant: job ~ W, linear, not flagged.
    assert shrinking["Gefen state / rank"]["job"] == pytest.approx(0.0, abs=1e-9)
    assert not any(f["flag"] for f in flat.values() if f["figure"].endswith("/ rank"))
    # Per-rank ~ W (what every rank reading the whole metadata does): job ~ W^2, flagged.
    g = growing["Gefen metadata (read by every rank)"]
    assert g["per_rank"] == pytest.approx(1.0) and g["job"] == pytest.approx(2.0) and g["flag"]
    assert growing["Gefen first-step agreement / rank"]["flag"]
    assert not growing["Gefen save gather at rank 0"]["flag"]  # one rank's receive: ~ W, linear


def test_benchmark_arguments_are_checked():
    with pytest.raises(SystemExit):
        bench_ckpt.parse_args(["--methods", "current,sgd,adamw"])
    with pytest.raises(SystemExit):
        bench_ckpt.parse_args(["--methods", "current"])  # every target is a ratio against AdamW
    with pytest.raises(SystemExit):
        bench_ckpt.parse_args(["--load-ranks", "2,x"])
    args = bench_ckpt.parse_args(["--model", "150M", "--methods", "current,adamw", "--load-ranks", "4,1"])
    assert args.methods == ["current", "adamw"] and args.load_ranks == [4, 1] and args.model == "150M"
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--models", "debug,1T"])
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--steps", "1"])
    assert bench_train.settings(bench_train.parse_args([]), "150M") == (4, 128, 2)
    with pytest.raises(SystemExit):
        scale.parse_args(["--meshes", "fsdp,ring"])
    assert scale.parse_args(["--worlds", "64,8,64"]).worlds == [8, 64]
    with pytest.raises(ValueError, match="multiple of --tp"):
        scale.mesh_for("fsdp_tp", 12, tp=8)


def test_checkpoint_targets_report_misses_with_the_figure():
    from gefen_titan.checkpoint.format import schema

    assert f"v{schema.VERSION}" in bench_ckpt.method_label("current")
    rss = [{"growth": 150, "state": 100, "shard": 50}, {"growth": 10, "state": 100, "shard": 50}]
    rows = [{"method": "current", "save_s": 0.6, "loads": {1: {"load_s": 0.5, "rss": rss}}},
            {"method": "adamw", "save_s": 1.0, "loads": {1: {"load_s": 1.0, "rss": rss}}}]
    got = {t["what"]: t for t in bench_ckpt.targets(rows, 2, [1])}
    assert got["save"]["ratio"] == pytest.approx(0.6) and not got["save"]["met"]
    assert got["load 2->1"]["met"]
    peak = next(t for w, t in got.items() if w.startswith("peak"))
    assert peak["ratio"] == pytest.approx(1.0) and peak["met"]  # the worst rank: 150 / (100 + 50)


def test_peak_rss_sees_a_region_below_an_earlier_peak():
    from benchmarks.rss import PeakRSS

    big = bytearray(96 << 20)
    big[:: 4096] = b"x" * len(big[:: 4096])
    del big
    with PeakRSS() as m:
        block = bytearray(32 << 20)
        block[:: 4096] = b"x" * len(block[:: 4096])
        del block
    assert (28 << 20) <= m.growth <= (48 << 20), m.growth
