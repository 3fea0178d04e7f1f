"""The reshard validation (``gefen_titan.validation``, command lines
``scripts/validate_reshard.py`` and ``gefen-titan validate``) end to end on
CPU (gloo): the standard set 2->4, 4->2, 2->1 of the debug recipe passes with
the state after every load bit-exact (agreed blocking, checkpoint format v3:
splits and merges alike); per-rank blocking (format v1) keeps its promises
(a same-size resume exact, a merge within the adapter's bounds); and a
broken resume (optimizer state dropped) makes the command fail, naming the
pair and the figure.

Small settings (``CI_SETTINGS``: save at step 4, 3 more steps, global batch
8 of local 2). The reference runs (at 1, 2 and 4 ranks: every size of the
pairs) are kept in a session cache shared with
tests/integration/test_recipe_regression.py (they are the runs of
llama_gefen_dp1.toml, llama_gefen.toml = llama_gefen_dp2.toml and
llama_gefen_dp4.toml), so each is trained once per session.

The commands are run as commands (never imported); the pieces are tested
through the package's modules.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen.validation import TOL_MOMENTUM, TOL_UPDATE, TOL_VMEAN
from gefen_titan.validation import bands, compare_global, identity, recipes, runs
from tests.helpers import processes, suite_cache

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "validate_reshard.py"

CI = runs.CI_SETTINGS

# Optimizer bytes per parameter of the checkpoint saved at N ranks (the
# reference of a pair N->M), measured with CI_SETTINGS on 2026-12-01 in
# format v3: 1.0624 at 2 ranks and at 4 (v2 measured 1.132 and 1.201: its
# torch.save framing, ~1.6 KB per entry per rank, grew with the ranks; v3's
# state entries are raw and the size no longer depends on N). The per-rank
# (v1) runs of the same test measure 1.052. What is framed besides the raw
# state is the record JSON, the codebook and the header (~6 KB in all); the
# margin, 0.002 B/param (12 KB at 6.16M parameters), leaves them room to
# grow by double, and is below one more framed entry per parameter
# (45 x ~1.6 KB x 2 ranks = 0.023 B/param).
OPT_BYTES_PER_PARAM = {2: 1.0624, 4: 1.0624}
OPT_BYTES_MARGIN = 0.002
CI_ARGS = ["--recipe", "recipes/llama_gefen.toml", "--backend", "gloo",
           "--steps-before", str(CI["steps_before"]), "--steps-after", str(CI["steps_after"]),
           "--global-batch", str(CI["global_batch"]), "--local-batch", str(CI["local_batch"])]


def reference_cache(tmp_path_factory) -> Path:
    return suite_cache.reference_cache(tmp_path_factory)


def validate(tmp_path_factory, out: Path, *args: str,
             package: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    """The script from the checkout's root, or (``package``) ``python -m gefen_titan validate`` from
    ``out`` with the recipe's absolute path; either way its ranks forked where the tests can fork
    (torchrun's launches of the same runs are pinned bit-identical by
    ``test_recipe_regression.py::test_forked_ranks_train_the_bits_torchrun_trains``)."""
    if package:
        ci_args = [str(ROOT / a) if a.endswith(".toml") else a for a in CI_ARGS]
        cmd, cwd = [sys.executable, "-m", "gefen_titan", "validate", *ci_args, *processes.validate_launcher()], out
    else:
        cmd, cwd = [sys.executable, str(SCRIPT), *CI_ARGS, *processes.validate_launcher()], ROOT
    cmd += ["--out", str(out), "--reference-cache", str(reference_cache(tmp_path_factory)), *args]
    proc = processes.run(cmd, cwd=cwd, timeout=850)  # below pytest-timeout's 900 s: a hang fails here, ranks stopped
    report = out / "report.json"
    return proc, (json.loads(report.read_text()) if report.exists() else {})


@pytest.fixture(scope="module")
def standard(tmp_path_factory):
    out = tmp_path_factory.mktemp("validate_standard")
    proc, report = validate(tmp_path_factory, out, "--pairs", "2:4,4:2,2:1")
    return proc, report, out


def _pair(report, name):
    return next(p for p in report["pairs"] if p["pair"] == name)


def _row(stdout: str, pair: str) -> list[str]:
    return next(line.split() for line in stdout.splitlines() if line.startswith(pair + " "))


def test_standard_set_passes_with_table_and_plot(standard):
    proc, report, out = standard
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "all pairs within tolerance" in proc.stdout
    assert "gloo on CPU" in proc.stdout  # says which backend it used
    assert "agreed blocking, checkpoint format v3" in proc.stdout
    for pair in ("2->4", "4->2", "2->1"):
        row = _row(proc.stdout, pair)
        assert row[-1] == "ok" and row[6] == "exact" and row[7] == "exact", row  # state, params
    # One figure a pair, each with the same resume's optimizer-dropped losses (docs/validation.md, "The figure").
    pairs = ("2->4", "4->2", "2->1")
    assert report["plots"] == {p: str(out / f"loss_curves-{p.replace('->', '-to-')}.png") for p in pairs}
    for png in report["plots"].values():
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p["pair"] for p in report["pairs"]] == ["2->4", "4->2", "2->1"]
    assert report["blocking"] == ["agreed"]
    steps = list(range(CI["steps_before"] + 1, CI["steps_before"] + CI["steps_after"] + 1))
    for p in report["pairs"]:
        assert sorted(int(s) for s in p["resumed_losses"]) == steps
        assert sorted(int(s) for s in p["dropped_losses"]) == steps
        assert p["failures"] == []
        assert p["checkpoint"]["total"] > 0 and p["save_seconds"] > 0 and p["load_seconds"] > 0


def test_state_after_every_load_is_bit_exact(standard):
    """Agreed blocking: splits (2->4) and merges (4->2, 2->1) alike reproduce
    the saved global state bit for bit."""
    _, report, _ = standard
    for p in report["pairs"]:
        st = p["state"]
        assert st["blocking"] == "agreed" and st["exact"] and st["params_exact"], (p["pair"], st)
        assert not st["problems"] and st["entries_differ"] == [], (p["pair"], st)
        assert st["momentum_rel_l2"] == st["vmean_rel_l2"] == st["first_update_rel_l2"] == 0.0
        assert st["dense_elements"] == report["parameters"]  # every parameter is Gefen's in this recipe
        assert st["entries"] > 2 * 45  # v3: codes and grid of every parameter, records, codebook
    # ~1 byte/param of optimizer state on disk (AdamW: 8): a code per element
    # and 8 B per block, stored raw (format v3), plus the framed records
    # (docs/validation.md).
    for p in report["pairs"]:
        per_param = p["checkpoint"]["optimizer"] / report["parameters"]
        assert 1.0 < per_param <= OPT_BYTES_PER_PARAM[p["source"]] + OPT_BYTES_MARGIN, (p["pair"], per_param)


def test_loss_band_is_measured_not_assumed(standard):
    _, report, _ = standard
    band = report["loss_band"]
    assert band["references"] == [1, 2, 4]  # every size of the pairs, targets included
    assert band["sigma_second_difference"] > 0 and band["sigma_between_references"] > 0
    assert band["band"] == pytest.approx(max(bands.LOSS_FLOOR, bands.LOSS_K * band["sigma"]))
    for p in report["pairs"]:
        assert p["loss_deviation"] <= band["band"]


def test_dropped_optimizer_state_fails_naming_pair_and_figure(standard, tmp_path_factory):
    """A resume that loads everything but the optimizer
    (``--checkpoint.exclude_from_loading optimizer``) must fail the command."""
    out = tmp_path_factory.mktemp("validate_fault")
    proc, report = validate(tmp_path_factory, out, "--pairs", "4:2", "--inject-fault", "drop-optimizer")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-6000:]
    assert "reusing" in proc.stdout  # the reference came from the shared cache
    assert _row(proc.stdout, "4->2")[6] == "DIFFER"
    err = proc.stderr
    assert "FAILED" in err
    assert "4->2: Gefen state after the load is not bit-exact (agreed blocking promises it, format v3 and later)" in err
    assert "4->2: first-update error 1 > 0" in err
    assert "4->2: momentum error 1 > 0" in err
    assert "have no optimizer state after the load" in err
    assert "4->2: step counters (period, step, vmean_step) differ after the load" in err
    assert f"figure: {out / 'loss_curves.png'}" in err  # one pair: the --plot path itself
    assert report["pairs"][0]["dropped_losses"] is None  # the fault is the resume: no second measure
    assert report["pairs"][0]["failures"] and report["fault"] == "drop-optimizer"


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    """Format v1 (``--blocking per_rank``), through the package's own command
    (``python -m gefen_titan validate``) run from outside the checkout."""
    out = tmp_path_factory.mktemp("validate_per_rank")
    proc, report = validate(tmp_path_factory, out, "--pairs", "2:2,2:1", "--blocking", "per_rank", "--no-dropped-state",
                            package=True)
    return proc, report, out


def _line(stdout: str, pair: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(pair + " "))


def test_per_rank_blocking_keeps_the_v1_promises(per_rank):
    """Per-rank blocking promises a bit-exact state where every target shard
    lies on whole blocks of one source rank (a same-size resume: all of it),
    and the adapter's bounds where it requantizes (a merge); parameters and
    counters exact everywhere. The table says which pair is which."""
    proc, report, out = per_rank
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert report["blocking"] == ["per_rank"]
    assert report["plots"] == {"2->2": str(out / "loss_curves-2-to-2.png"), "2->1": str(out / "loss_curves-2-to-1.png")}
    assert report["tolerances"]["per_rank"] == {"momentum_rel_l2": TOL_MOMENTUM, "vmean_rel_l2": TOL_VMEAN,
                                                "first_update_rel_l2": TOL_UPDATE}
    assert "state after load (per-rank blocking, format v1" in proc.stdout

    same = _pair(report, "2->2")
    st = same["state"]
    assert st["blocking"] == "per_rank" and st["exact"] and st["params_exact"] and not st["problems"], st
    assert st["exact_promised_fraction"] == 1.0 and st["exact_held"]
    assert st["momentum_rel_l2"] == st["vmean_rel_l2"] == st["first_update_rel_l2"] == 0.0
    assert same["loss_band"] == 0.0 and same["loss_deviation"] == 0.0  # the same batches from the same state
    row = _row(proc.stdout, "2->2")
    assert row[6] == "exact" and row[7] == "exact" and row[-1] == "ok", row

    merge = _pair(report, "2->1")
    st = merge["state"]
    assert merge["failures"] == [] and not st["problems"], merge["failures"]
    assert not st["exact"] and st["exact_held"] and st["params_exact"]  # requantized, nothing broken
    assert 0 < st["momentum_rel_l2"] <= TOL_MOMENTUM and st["vmean_rel_l2"] <= TOL_VMEAN
    assert 0 < st["first_update_rel_l2"] <= TOL_UPDATE
    line = _line(proc.stdout, "2->1")
    assert f"{100 * st['exact_promised_fraction']:.0f}% exact" in line and line.split()[-1] == "ok", line
    assert "BROKEN" not in line and "DIFFER" not in line


# ------------------------------------------------ pieces, no training (fast)
def _global_dump(world=2):
    """A tiny agreed-blocking dump as ``gefen_titan.validation.hooks`` writes it."""
    import torch

    from gefen_titan.checkpoint.format import schema

    g = torch.Generator().manual_seed(0)
    codebook = torch.linspace(-1, 1, 256)
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    record = {"blocking": "agreed", "deterministic": False, "global_step": 4,
              "params": [{"fqn": "w", "shape": [4, 8], "period": 4, "step": 4, "vmean_step": 4, "group": hyper}]}
    state = {
        schema.header_key(): json.dumps({"format": "gefen-titan", "version": 2, "blocking": "agreed"}),
        gefen_keys.optimizer_key("w"): json.dumps(record, sort_keys=True),
        gefen_keys.codebook_key("w"): codebook,
        gefen_keys.codes_key("w"): torch.randint(0, 256, (4, 8), generator=g, dtype=torch.uint8),
        gefen_keys.magnitude_key("w"): torch.rand(4, 2, generator=g),
        gefen_keys.vmean_key("w"): torch.rand(4, 2, generator=g),
        "state.n.exp_avg": torch.randn(8, generator=g),
    }
    live = {"params": {"w": {"optimizer": "w", "period": 4, "step": 4, "vmean_step": 4, "has_state": True,
                             "local_numel": 16, "hyper": hyper}},
            "optimizers": {"w": {"codebook": codebook.clone(), "global_step": 4}}}
    return {"kind": "save", "step": 4, "rank": 0, "world": world, "blocking": "agreed", "dump_version": 2,
            "seconds": [0.1] * world, "live": [{"Gefen": copy.deepcopy(live)} for _ in range(world)],
            "covers": list(range(world)), "params": {"w": torch.randn(4, 8, generator=g)}, "state": state}


def test_global_comparison_is_bit_exact_and_names_what_differs():
    from gefen_titan.checkpoint.format import schema

    ref = _global_dump()
    st = compare_global.compare_global_state([ref], [copy.deepcopy(ref)])
    assert st["exact"] and not st["problems"] and st["momentum_rel_l2"] == 0.0

    res = copy.deepcopy(ref)
    res["state"][gefen_keys.codes_key("w")][1, 2] ^= 1  # one code, one bit
    st = compare_global.compare_global_state([ref], [res])
    assert not st["exact"] and st["entries_differ"] == [gefen_keys.codes_key("w")]
    assert "not bit-exact" in st["problems"][0] and 0 < st["momentum_rel_l2"] < 1

    res = copy.deepcopy(ref)
    res["params"]["w"] = res["params"]["w"].double()  # equal values, other dtype
    assert compare_global.compare_global_state([ref], [res])["problems"] == ["parameters differ after load (1: w)"]

    res = copy.deepcopy(ref)
    res["live"][1]["Gefen"]["optimizers"]["w"]["codebook"][7] += 1e-7  # one rank's live codebook
    assert "the live codebook differs" in compare_global.compare_global_state([ref], [res])["problems"][0]

    res = copy.deepcopy(ref)
    res["state"]["state.n.exp_avg"][0] += 1  # another optimizer's state
    problem = compare_global.compare_global_state([ref], [res])["problems"][0]
    assert "the flat state of the other optimizers differs" in problem

    res = copy.deepcopy(ref)
    res["state"][schema.header_key()] = res["state"][schema.header_key()].replace("agreed", "per_rank")
    assert "format's shared entries differ" in compare_global.compare_global_state([ref], [res])["problems"][0]

    res = copy.deepcopy(ref)
    del res["state"][gefen_keys.vmean_key("w")]
    st = compare_global.compare_global_state([ref], [res])
    assert f"{gefen_keys.vmean_key('w')} (missing)" in st["entries_differ"]
    assert any("have no optimizer state" in p for p in st["problems"])

    res = copy.deepcopy(ref)
    res["covers"] = [0]  # a writer's dump lost
    assert "do not cover every rank" in compare_global.compare_global_state([ref], [res])["problems"][0]


def test_state_comparisons_ask_each_kind_through_its_entry():
    """The comparisons name no kind: a kind's live facts and per-rank picture reach its own
    ``validation`` through its registry entry (a third kind's too), what no kind reads is a
    problem, and a kind's record names the field that differs."""
    import torch

    from gefen_titan.optim import registry
    from gefen_titan.optim.kind_validation import KindValidation
    from gefen_titan.validation import compare_rank

    ref = _global_dump()
    res = copy.deepcopy(ref)
    rec = json.loads(res["state"][gefen_keys.optimizer_key("w")])
    rec["params"][0]["period"] = 8  # one field of Gefen's record
    res["state"][gefen_keys.optimizer_key("w")] = json.dumps(rec, sort_keys=True)
    st = compare_global.compare_global_state([ref], [res])
    assert st["entries_differ"] == [f"{gefen_keys.optimizer_key('w')} (params w period 8 != saved 4)"]
    assert any("have no optimizer state" in p for p in st["problems"])  # its blocks no longer fit the record

    seen = []

    def problems(saved, resumed):
        seen.append((saved, resumed))
        return [] if saved == resumed else ["the third kind's facts differ"]

    def per_rank(saved, resumed):
        return {"problems": [], "exact": saved == resumed, "third_figure": 0.5}

    third = registry.OptimizerSpec(
        name="ThirdKind", factory=torch.optim.SGD, owns=lambda o: False, group_keys=("lr",),
        validation=KindValidation(live_facts=lambda opts: {}, live_problems=problems, compare_rank=per_rank))
    ref = _global_dump()
    for r, live in enumerate(ref["live"]):
        live["ThirdKind"] = {"rank": r}
    res = copy.deepcopy(ref)
    res["live"][1]["ThirdKind"]["rank"] = 0
    rank_dumps = [{"params": {}, "other_optim": {}, "kinds": {"ThirdKind": {"r": r}}} for r in range(2)]
    registry.register(third)
    try:
        assert compare_global.compare_global_state([ref], [copy.deepcopy(ref)])["exact"]
        assert compare_global.compare_global_state([ref], [res])["problems"] == ["the third kind's facts differ"]
        assert seen[-1] == ([{"rank": 0}, {"rank": 1}], [{"rank": 0}, {"rank": 0}])
        st = compare_rank.compare_state(rank_dumps, copy.deepcopy(rank_dumps))
        assert st["exact"] and st["third_figure"] == 0.5 and not st["problems"]
        assert not compare_rank.compare_state(rank_dumps, rank_dumps[::-1])["exact"]
    finally:
        registry.unregister("ThirdKind")
    assert compare_global.compare_global_state([ref], [res])["problems"] == [
        "the dumps hold live facts of ThirdKind, which no registered kind reads"]
    assert compare_rank.compare_state(rank_dumps, rank_dumps)["problems"] == [
        "the dumps hold per-rank state of ThirdKind, which no registered kind reads"]


def test_blocking_option_reaches_every_run():
    s = runs.Settings(recipe="recipes/llama_gefen.toml", blocking="per_rank", **CI)
    args = s.overrides(2)
    assert args[args.index("--optimizer.blocking.mode") + 1] == "per_rank"
    assert "--optimizer.blocking.mode" not in runs.Settings(recipe="recipes/llama_gefen.toml", **CI).overrides(2)


def test_equal_runs_share_one_identity(tmp_path):
    s = runs.Settings(recipe="recipes/llama_gefen.toml", **CI)
    base2 = identity.run_identity("recipes/llama_gefen.toml", 2, s.overrides(2))
    assert base2 == identity.run_identity("recipes/llama_gefen_dp2.toml", 2, s.overrides(2))
    assert base2 != identity.run_identity("recipes/llama_gefen.toml", 4, s.overrides(4))
    assert base2 != identity.run_identity("recipes/llama_gefen_mixed.toml", 2, s.overrides(2))
    assert base2 != identity.run_identity("recipes/llama_gefen.toml", 2, s.overrides(2) + ["--optimizer.lr", "1e-3"])
    v1 = runs.Settings(recipe="recipes/llama_gefen.toml", blocking="per_rank", **CI)
    assert base2 != identity.run_identity("recipes/llama_gefen.toml", 2, v1.overrides(2))
    # An older recipe's flat [optimizer] key is the same run as its kind's table.
    base = f'[job]\nextends = "{Path("recipes/llama_gefen.toml").resolve()}"\n'
    (tmp_path / "flat.toml").write_text(base + "[optimizer]\nmuon_bucket_mib = 64\n")
    (tmp_path / "table.toml").write_text(base + "[optimizer.muon]\nbucket_mib = 64\n")
    flat, table = (identity.run_identity(str(tmp_path / n), 2, s.overrides(2)) for n in ("flat.toml", "table.toml"))
    assert flat == table != base2


def test_identity_holds_the_code_and_the_library_versions(tmp_path):
    """A reference trained by other code (an edited optimizer) or under
    other libraries is another run: the cache key changes with either."""
    s = runs.Settings(recipe="recipes/llama_gefen.toml", **CI)
    args = s.overrides(2)
    base = identity.run_identity("recipes/llama_gefen.toml", 2, args)
    installed = identity.installed_code_digest()
    assert base == identity.run_identity("recipes/llama_gefen.toml", 2, args, code=installed,
                                         versions=identity.library_versions())
    assert set(identity.library_versions()) == {"torch", "torchtitan", "gefen-x"}

    # A copy of the package digests as the package; one edited line of the optimizer does not.
    roots = identity.package_roots()
    copies = [tmp_path / r.name for r in roots]
    for root, dest in zip(roots, copies):
        shutil.copytree(root, dest, ignore=shutil.ignore_patterns("__pycache__"))
    assert identity.code_digest(copies) == installed
    with open(tmp_path / "gefen_titan" / "optim" / "container.py", "a") as f:
        f.write("# edited\n")
    edited = identity.code_digest(copies)
    assert edited != installed
    assert identity.run_identity("recipes/llama_gefen.toml", 2, args, code=edited) != base

    for dist in identity.LIBRARIES:
        other = {**identity.library_versions(), dist: "0.0.0"}
        assert identity.run_identity("recipes/llama_gefen.toml", 2, args, versions=other) != base, dist


def test_recipe_is_a_path_from_the_current_directory(tmp_path, monkeypatch, capsys):
    """The package's command knows no recipe folder of its own: a path that
    exists only in the checkout is refused, naming the path, before any run."""
    from gefen_titan import cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["validate", "--recipe", "recipes/llama_gefen.toml", "--pairs", "1:1", "--out", str(tmp_path)])
    assert "recipes/llama_gefen.toml" in str(e.value) and str(tmp_path) in str(e.value)
    assert not (tmp_path / "report.json").exists()
    with pytest.raises(SystemExit) as e:
        cli.main(["validate", "--pairs", "1:1"])  # no default recipe in the package
    assert e.value.code == 2 and "--recipe" in capsys.readouterr().err
    recipe = str(ROOT / "recipes" / "llama_gefen.toml")
    assert recipes.resolve_recipe(recipe) == recipe


def test_second_difference_noise_measures_batch_noise():
    import random

    rng = random.Random(0)
    sigma = 0.05
    curve = {t: 8.0 - 0.01 * t + rng.gauss(0, sigma) for t in range(1, 2001)}
    # the spread of the difference of two runs' losses: sqrt(2) sigma
    assert bands.second_difference_noise(curve) == pytest.approx(sigma * 2 ** 0.5, rel=0.05)
    assert bands.second_difference_noise({1: 8.0, 2: 7.0, 3: 6.0, 4: 5.0}) == 0.0  # a straight line is no noise


def test_hook_override_reaches_the_config():
    """launch's --override.imports tokens parse back, through train.py's
    command line, to the recipe's imports plus the hook with its kwargs."""
    from gefen_titan.recipe.cli import load_cli

    recipe = "recipes/llama_gefen.toml"
    hook = ["gefen_titan.validation.hooks.dump_state", {"dir": "/tmp/x y", "save_steps": [4]}]
    imports = recipes.recipe_imports(recipe)
    argv = ["--job.config", recipes.resolve_recipe(recipe), *runs.imports_flag(imports + [hook])]
    config = load_cli(argv, world_size=2).config
    assert config.override.imports == imports + [tuple(hook)]
