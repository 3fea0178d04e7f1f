"""The validation's per-side layouts, without training: the pair syntax and
its messages, the overrides each side's runs get, the reference cache key,
the checks made before any run, the batch records of TP ranks, and the
parameter comparison (``gefen_titan.validation.layouts``, ``preflight``,
``runs``, ``identity``, ``params``). The runs themselves:
tests/integration/test_validate_layouts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.io import storage
from gefen_titan.validation import bands, command, identity, params, preflight, report, runs
from gefen_titan.validation.layouts import LayoutError, Side, parse_pairs, parse_side

CI = runs.CI_SETTINGS
DEBUG = "recipes/llama_gefen.toml"
GLOBAL = "recipes/llama_gefen_global_order.toml"
TP2 = "recipes/llama_gefen_tp2.toml"
DSV3 = "recipes/dsv3_gefen.toml"
ROOT = Path(__file__).resolve().parents[2]
PP2 = "recipes/llama_gefen_pp2.toml"


def flag(args: list[str], name: str) -> str | None:
    key = f"--parallelism.{name}"
    return args[args.index(key) + 1] if key in args else None


# ------------------------------------------------------------------ syntax
@pytest.mark.parametrize("text,nproc,layout,label", [
    ("2", 2, None, "2"),
    ("2@ep2", 2, (("ep", 2),), "2@ep2"),
    ("4@ep2xtp2", 4, (("tp", 2), ("ep", 2)), "4@tp2xep2"),  # one order, whatever the spelling
    ("4@tp2xep2", 4, (("tp", 2), ("ep", 2)), "4@tp2xep2"),
    ("4@fsdp2xtp2", 4, (("tp", 2),), "4@tp2"),  # naming the shard degree only checks it
    ("2@fsdp2", 2, (), "2@fsdp2"),  # pure FSDP, whatever the recipe pins
    ("8@rep2xtp2", 8, (("rep", 2), ("tp", 2)), "8@rep2xtp2"),
    ("4@pp2xcp2", 4, (("pp", 2), ("cp", 2)), "4@pp2xcp2"),
    ("2@tp1", 2, (), "2@fsdp2"),
])
def test_sides_parse_to_one_canonical_layout(text, nproc, layout, label):
    side = parse_side(text)
    assert (side.nproc, side.layout, side.label) == (nproc, layout, label)
    assert parse_side(side.label) == side
    assert side.key == (nproc if layout is None else label)


@pytest.mark.parametrize("text,message", [
    ("0", "a side is N or N@LAYOUT with N >= 1"),
    ("two", "a side is N or N@LAYOUT"),
    ("2@", "nothing after '@'"),
    ("2@dp2", "'dp2' is not a degree: write NAME K with NAME one of pp, rep, fsdp, cp, tp, ep"),
    ("4@tp2ep2", "'tp2ep2' is not a degree"),
    ("2@ep2x", "'' is not a degree"),
    ("2@tp", "'tp' is not a degree"),
    ("2@tp2xtp2", "tp is named twice"),
    ("2@tp0", "a degree is >= 1"),
    ("2@tp3", "tp 3 does not divide 2 processes"),
    ("8@pp2xtp3", "pp 2 x tp 3 = 6 does not divide 8 processes"),
    ("2@fsdp1", "fsdp 1 does not fill 2 processes: the other degrees leave fsdp 2"),
    ("2@ep4", "ep 4 does not divide fsdp x cp x tp = 2, the ranks expert parallelism borrows"),
    ("4@pp2xep4", "ep 4 does not divide fsdp x cp x tp = 2"),
])
def test_bad_sides_are_refused_naming_what_to_write(text, message):
    with pytest.raises(LayoutError) as e:
        parse_side(text)
    assert message in str(e.value) and repr(text) in str(e.value)


def test_pairs_name_the_pair_and_the_side_that_is_wrong():
    assert parse_pairs("2:4, 2@ep2:1") == [(Side(2), Side(4)), (parse_side("2@ep2"), Side(1))]
    assert parse_pairs(None, "2@ep2", 1) == [(parse_side("2@ep2"), Side(1))]
    for text, message in [("2:3@tp2", "pair '2:3@tp2', target side: '3@tp2': tp 2 does not divide 3 processes"),
                          ("2@tp4:2", "pair '2@tp4:2', source side: '2@tp4'"),
                          ("2:4:1", "pair '2:4:1': expected SIDE:SIDE"),
                          ("2", "pair '2': expected SIDE:SIDE")]:
        with pytest.raises(LayoutError) as e:
            parse_pairs(text)
        assert message in str(e.value), str(e.value)
    with pytest.raises(LayoutError, match="give --from SIDE --to SIDE"):
        parse_pairs(None, "2", None)
    with pytest.raises(SystemExit, match="--pairs: pair '2:1@ep3'"):  # the command's form
        command.parse_pairs("2:1@ep3")


# --------------------------------------------------------------- overrides
def test_a_bare_side_keeps_the_flags_every_run_had_before_layouts():
    s = runs.Settings(recipe=DEBUG, **CI)
    for nproc in (1, 2, 4):
        args = s.overrides(nproc)
        assert args == s.overrides(Side(nproc))
        assert [a for a in args if a.startswith("--parallelism.")] == ["--parallelism.data_parallel_shard_degree"]
        assert flag(args, "data_parallel_shard_degree") == str(nproc)
        assert "--training.disable_cuda_graphs" not in args
    # A recipe that pins degrees still trains at them: TP 2, FSDP what is left.
    tp = runs.Settings(recipe=TP2, **CI)
    assert flag(tp.overrides(2), "data_parallel_shard_degree") == "1"
    assert flag(tp.overrides(4), "data_parallel_shard_degree") == "2"
    assert flag(tp.overrides(2), "tensor_parallel_degree") is None  # the recipe's own
    with pytest.raises(LayoutError, match=r"3: the recipe's degrees \(tp 2\) do not divide 3 processes"):
        tp.overrides(3)


def test_a_side_layout_overrides_the_recipes_degrees():
    tp = runs.Settings(recipe=TP2, **CI)
    fsdp = tp.overrides(parse_side("2@fsdp2"))  # TP 2 recipe, pure FSDP side
    assert flag(fsdp, "tensor_parallel_degree") == "1" and flag(fsdp, "data_parallel_shard_degree") == "2"
    s = runs.Settings(recipe=GLOBAL, **CI)
    args = s.overrides(parse_side("4@pp2xtp2"))
    assert {k: flag(args, k) for k in ("pipeline_parallel_degree", "tensor_parallel_degree",
                                       "data_parallel_shard_degree", "data_parallel_replicate_degree",
                                       "context_parallel_degree", "expert_parallel_degree")} == {
        "pipeline_parallel_degree": "2", "tensor_parallel_degree": "2", "data_parallel_shard_degree": "1",
        "data_parallel_replicate_degree": "1", "context_parallel_degree": "1", "expert_parallel_degree": "1"}
    # The layout comes before --set (the user's last word) and after the common flags.
    assert args.index("--training.steps") < args.index("--parallelism.pipeline_parallel_degree")
    assert s.degrees(parse_side("8@rep2xtp2")) == {"pp": 1, "rep": 2, "fsdp": 2, "cp": 1, "tp": 2, "ep": 1}


def test_torchtitans_cuda_graph_demand_is_met_per_side():
    """EP > 1 and PP > 1 need --training.disable_cuda_graphs (torchtitan's
    check, on CPU too); added only to those sides, and only where the recipe
    has not set it."""
    s = runs.Settings(recipe=GLOBAL, **CI)
    for text, wanted in (("2@pp2", True), ("2@ep2", True), ("2@tp2", False), ("2", False)):
        args = s.overrides(parse_side(text))
        assert ("--training.disable_cuda_graphs" in args) == wanted, text
        if wanted:
            assert args[args.index("--training.disable_cuda_graphs") + 1] == "true"
    pp = runs.Settings(recipe=PP2, **CI)  # sets it itself
    assert "--training.disable_cuda_graphs" not in pp.overrides(2)
    assert "--training.disable_cuda_graphs" not in pp.overrides(parse_side("2@pp2"))


# --------------------------------------------------------------- cache key
def test_the_cache_key_holds_the_layout_not_its_spelling():
    s, tp = runs.Settings(recipe=DEBUG, **CI), runs.Settings(recipe=TP2, **CI)
    plain = identity.run_identity(DEBUG, 2, s.overrides(2))
    at_tp2 = identity.run_identity(DEBUG, 2, s.overrides(parse_side("2@tp2")))
    assert at_tp2 != plain  # same processes, another layout: another run
    assert at_tp2 == identity.run_identity(TP2, 2, tp.overrides(2))  # the recipe that pins TP 2
    assert plain == identity.run_identity(DEBUG, 2, s.overrides(parse_side("2@fsdp2")))
    assert plain != identity.run_identity(DEBUG, 2, s.overrides(parse_side("2@pp2")))
    assert identity.run_layout(DEBUG, 2, s.overrides(parse_side("2@tp2"))) == {
        "pp": 1, "rep": 1, "fsdp": 1, "cp": 1, "tp": 2, "ep": 1}
    assert identity.run_layout(DEBUG, 4, s.common_overrides())["fsdp"] == 4  # -1 filled in


# ----------------------------------------------------------------- preflight
@pytest.mark.parametrize("recipe,pairs,message", [
    (GLOBAL, "2:2@ep2", "pair 2:2@ep2, target side 2@ep2 (2 processes): "  # the recipe layer's check
                        f"{ROOT / GLOBAL}: [parallelism] expert_parallel_degree = 2, but llama3 debugmodel has no "
                        "mixture-of-experts layers"),
    (DSV3, "2:3@ep3", "target side 3@ep3 (3 processes): "
                      f"{ROOT / DSV3}: [parallelism] expert_parallel_degree (3) does not divide the 8 experts"),
    (GLOBAL, "2:32@tp32", "target side 32@tp32 (32 processes): tp 32 does not divide the model's n_heads = 16"),
    ("recipes/qwen3_moe_gefen.toml", "2:4@tp4", "tp 4 does not divide the model's n_kv_heads = 2"),
    (GLOBAL, "2:8@pp8", "target side 8@pp8 (8 processes): pp 8: the model has 6 layers, fewer than the stages"),
    (GLOBAL, "3:1", "pair 3:1, source side 3 (3 processes): "  # the recipe layer's own check at that size
                    f"{ROOT / GLOBAL}: [training] global_batch_size 8 is not a multiple of local_batch_size 2 x "
                    "data-parallel degree 3"),
    (GLOBAL, "2:4@tp4", "pair 2:4@tp4, target side 4@tp4: tp 4: the source's checkpoint is blocked for TP degrees "
                        "dividing optimizer.blocking.max_tensor_parallel_degree = 2"),
    (TP2, "2:3", "pair 2:3, target side 3 (3 processes): the recipe's degrees (tp 2) do not divide 3 processes"),
])
def test_sides_no_run_can_take_fail_before_any_run(recipe, pairs, message):
    s = runs.Settings(recipe=recipe, **CI)
    with pytest.raises(LayoutError) as e:
        preflight.check_pairs(s, parse_pairs(pairs))
    assert message in str(e.value), str(e.value)


def test_sides_the_recipe_takes_pass_the_preflight():
    preflight.check_pairs(runs.Settings(recipe=GLOBAL, **CI), parse_pairs("2:1,2:2@tp2,4@tp2:2,2:4@tp2,4:4@pp2"))
    preflight.check_pairs(runs.Settings(recipe=TP2, **CI), parse_pairs("2:4,2:2@fsdp2"))
    preflight.check_pairs(runs.Settings(recipe=DSV3, **CI), parse_pairs("2@ep2:2,2@ep2:1,2:4@ep4xtp2"))


def test_the_command_refuses_before_any_run(tmp_path):
    with pytest.raises(SystemExit) as e:
        command.validate(recipe=GLOBAL, pairs="2:2@ep2", out=str(tmp_path), backend="gloo", **CI)
    assert "has no mixture-of-experts layers" in str(e.value)
    with pytest.raises(SystemExit) as e:  # a --set degree would override every side's layout
        command.validate(recipe=GLOBAL, pairs="2:2@tp2", sets=["parallelism.tensor_parallel_degree=1"],
                         out=str(tmp_path), backend="gloo", **CI)
    assert "--set parallelism.tensor_parallel_degree: would override every side's layout" in str(e.value)
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


# ------------------------------------------------------------ batch records
def _records(folder: Path, rows: dict[str, list[dict]]) -> runs.Run:
    (folder / "batches").mkdir(parents=True)
    for name, lines in rows.items():
        (folder / "batches" / name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    return runs.Run(str(folder), 2, {}, 1.0, layout="2@tp2")


def test_the_ranks_of_one_data_shard_count_their_microbatch_once(tmp_path):
    row = {"start": 0, "dp_rank": 0, "dp_world_size": 1, "sample_ids": [3, 1]}
    tp = _records(tmp_path / "tp", {"batches-dp1-rank0-g0.jsonl": [row, {**row, "start": 2, "sample_ids": [0, 2]}],
                                    "batches-dp1-rank0-g1.jsonl": [row, {**row, "start": 2, "sample_ids": [0, 2]}]})
    assert tp.batches(4) == {1: [0, 1, 2, 3]}
    assert tp.side == parse_side("2@tp2")
    # A TP rank that read other samples, or a rank that read one microbatch twice, is seen.
    odd = _records(tmp_path / "odd", {"batches-dp1-rank0-g0.jsonl": [row],
                                      "batches-dp1-rank0-g1.jsonl": [{**row, "sample_ids": [3, 5]}]})
    assert odd.batches(4) == {1: [1, 3, 3, 5]}
    twice = _records(tmp_path / "twice", {"batches-dp1-rank0-g0.jsonl": [row, row]})
    assert twice.batches(4) == {1: [1, 1, 3, 3]}


# -------------------------------------------------------- final parameters
def _final(folder: Path, tensors: dict[str, torch.Tensor], step: int = 7) -> runs.Run:
    """A run folder whose last checkpoint (model only, as the validation's runs
    write it) holds ``tensors``, written by gefen_titan's writer."""
    sd = {k: v.clone() for k, v in tensors.items()}
    dcp.save(sd, storage_writer=storage.storage_writer(folder / "checkpoint" / f"step-{step}"), no_dist=True)
    return runs.Run(str(folder), 1, {}, 1.0)


MODEL = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}


def test_parameter_deviation_is_read_through_the_checked_reader(tmp_path):
    s = runs.Settings(recipe=GLOBAL, steps_before=4, steps_after=3)
    a = _final(tmp_path / "a", MODEL)
    b = _final(tmp_path / "b", MODEL)
    same = params.param_deviation(params.final_checkpoint(a, s), params.final_checkpoint(b, s))
    assert same["exact"] and same["rel_l2"] == same["max_abs"] == 0.0 and same["entries"] == 2
    assert same["elements"] == 17
    moved = {**MODEL, "w": MODEL["w"].clone()}
    moved["w"][1, 2] += 0.5
    dev = params.param_deviation(params.final_checkpoint(_final(tmp_path / "c", moved), s),
                                 params.final_checkpoint(a, s))
    want_norm = float(torch.cat([MODEL["w"].flatten(), MODEL["b"]]).double().norm())
    assert not dev["exact"] and dev["entries_differ"] == 1 and dev["first_differ"] == ["w"]
    assert dev["max_abs"] == 0.5 and dev["rel_l2"] == pytest.approx(0.5 / want_norm)
    # Chunked reads give the same figures.
    assert params.param_deviation(params.final_checkpoint(_final(tmp_path / "d", moved), s),
                                  params.final_checkpoint(a, s), chunk_bytes=1) == {**dev}
    short = params.param_deviation(params.final_checkpoint(_final(tmp_path / "e", {"w": MODEL["w"]}), s),
                                   params.final_checkpoint(a, s))
    assert short["problems"] == ["1 model entries missing, e.g. ['b']"] and not short["exact"]
    # A damaged data file is refused by the checked reader, not compared.
    data = next((tmp_path / "c" / "checkpoint" / "step-7").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(GefenCheckpointError, match="is corrupt: .* digest mismatch"):
        params.param_deviation(params.final_checkpoint(runs.Run(str(tmp_path / "c"), 1, {}, 1.0), s),
                               params.final_checkpoint(a, s))


def test_parameter_band_is_measured_from_the_references(tmp_path):
    s = runs.Settings(recipe=GLOBAL, steps_before=4, steps_after=3)
    other = {**MODEL, "w": MODEL["w"] + 1e-3}
    refs = {Side(2): _final(tmp_path / "r2", MODEL), parse_side("2@tp2"): _final(tmp_path / "tp", other)}
    refs[parse_side("2@tp2")].layout = "2@tp2"
    rerun = _final(tmp_path / "rerun", MODEL)
    rerun.nproc = 2
    band = params.param_band(refs, rerun, s)
    between = params.param_deviation(params.final_checkpoint(refs[parse_side("2@tp2")], s),
                                     params.final_checkpoint(refs[Side(2)], s))
    assert band["rerun_deviation"] == {"rel_l2": 0.0, "max_abs": 0.0}
    assert band["references"] == [2, "2@tp2"] and band["reduction_order_between"]["rel_l2"] == [2, "2@tp2"]
    assert band["reduction_order_deviation"]["max_abs"] == pytest.approx(1e-3, rel=1e-3)
    assert band["band"]["max_abs"] == pytest.approx(bands.LOSS_K * band["reduction_order_deviation"]["max_abs"])
    assert band["reduction_order_deviation"]["rel_l2"] > 0.9 * between["rel_l2"]
    # A resume at its own layout must give the rerun's bits (0 on CPU); another layout gets the band.
    assert params.pair_param_band(2, 2, band) == {"rel_l2": 0.0, "max_abs": 0.0}
    assert params.pair_param_band(2, parse_side("2@tp2"), band) == band["band"]


def test_parameter_failure_lines_and_the_table_column():
    """What a pair beyond the parameter tolerance prints (its failing the
    command: tests/integration/test_validate_layouts.py's broken resume)."""
    dev = {"rel_l2": 2e-3, "max_abs": 1e-2, "entries": 57, "entries_differ": 57, "first_differ": ["w"],
           "exact": False, "problems": []}
    tol = {"rel_l2": 4e-5, "max_abs": 1e-3}
    lines = params.param_problems("2->2@tp2", parse_side("2@tp2"), dev, tol, 7)
    assert lines[0].startswith("2->2@tp2: parameters at step 7 differ from the uninterrupted run at 2@tp2 beyond "
                               "the reduction order: relative L2 0.002 > 4e-05")
    assert "max |diff| 0.01 > 0.001" in lines[1]
    assert params.param_problems("2->1", Side(1), {**dev, "rel_l2": 1e-5, "max_abs": 1e-4}, tol, 7) == []
    assert report.final_params_verdict({**dev, "tolerance": tol}) == "2.0e-03 FAR"
    assert report.final_params_verdict({**dev, "rel_l2": 1e-5, "max_abs": 1e-4, "tolerance": tol}) == "1.0e-05"
    assert report.final_params_verdict({**dev, "exact": True, "tolerance": tol}) == "exact"


# ------------------------------------------------------------------ launchers
def test_the_fork_launcher_is_refused_before_any_run_where_it_cannot_start_ranks(monkeypatch, tmp_path):
    """``--launcher fork`` forks gloo ranks from a server that imported torch: refused, saying why and
    what to use, where that cannot work (a CUDA build of torch, not Linux, or NCCL runs)."""
    from gefen_titan.validation import launchers

    monkeypatch.setattr(launchers, "can_fork", lambda: "the fork launcher needs a CPU-only torch")
    with pytest.raises(SystemExit, match=r"--launcher fork: the fork launcher needs a CPU-only torch \(use "
                                         r"--launcher torchrun"):
        command.validate(recipe=DEBUG, pairs="2:1", backend="gloo", launcher="fork", out=str(tmp_path / "v"))
    monkeypatch.setattr(launchers, "can_fork", lambda: None)
    monkeypatch.setattr(command, "choose_backend", lambda backend, n: ("nccl", "2 GPUs"))
    with pytest.raises(SystemExit, match="NCCL runs need torchrun"):
        command.validate(recipe=DEBUG, pairs="2:1", backend="nccl", launcher="fork", out=str(tmp_path / "v"))
    assert not (tmp_path / "v").exists()  # nothing ran, nothing written
    with pytest.raises(ValueError, match="launcher must be one of"):
        launchers.launch_ranks("mpirun", 1, [], log=tmp_path / "log", env={}, port=0)


def test_callers_sharing_a_reference_cache_train_each_run_once(monkeypatch, tmp_path):
    """The suite's parallel workers and concurrent validate commands share one
    cache: a caller that finds a run being trained waits for it and reads it,
    it does not train it again nor read it half-written (the cache's lock)."""
    import multiprocessing
    import time

    trained, cache = tmp_path / "trained", tmp_path / "cache"

    def fake_launch(settings, side, folder, extra, save_steps, env, quiet=False):
        with open(trained, "a") as f:
            f.write(f"{folder}\n")
        time.sleep(1.0)  # the other caller arrives while the run trains
        folder.mkdir(parents=True)
        run = runs.Run(folder=str(folder), nproc=side.nproc, losses={1: 1.0}, seconds=1.0)
        (folder / "run.json").write_text(json.dumps(runs.asdict(run)))
        return run

    def caller(i: int) -> None:
        run = runs.reference_run(runs.Settings(recipe=DEBUG, **CI), 1, out=tmp_path, cache=cache, quiet=True)
        (tmp_path / f"got-{i}").write_text(json.dumps([run.folder, run.losses]))

    monkeypatch.setattr(runs, "launch", fake_launch)
    # Processes, as the suite's workers are (torchtitan's config registry is not thread-safe).
    callers = [multiprocessing.get_context("fork").Process(target=caller, args=(i,)) for i in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(60)
    assert [c.exitcode for c in callers] == [0, 0]
    assert len(trained.read_text().splitlines()) == 1
    assert json.loads((tmp_path / "got-0").read_text()) == json.loads((tmp_path / "got-1").read_text())
