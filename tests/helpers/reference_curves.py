"""Regenerate (or check) the stored loss curves of the CPU recipes.

    python scripts/update_reference_curves.py            # rewrite tests/reference_curves/*.json
    python scripts/update_reference_curves.py --check    # compare only; exit 1 on a deviation
    python scripts/update_reference_curves.py --recipes llama_gefen_mixed
    python scripts/update_reference_curves.py --drift host --recipes qwen3_moe_gefen --optimizer AdamW

The torchft recipes (a ``[fault_tolerance]`` section) run as a lighthouse and
2 replica groups of 2 ranks, uninterrupted, with the fault-tolerance tests'
settings (``tests.helpers.ft_runs``); their files hold each group's curve,
which ``tests/integration/test_fault_tolerance.py`` compares with. Every other
CPU recipe (``CPU_GLOBS``: ``recipes/llama_gefen*.toml`` and the
mixture-of-experts ``dsv3_gefen*.toml``, ``qwen3_moe_gefen*.toml``) runs on CPU (gloo) at its own number of
processes (``recipe.declared_world_size``: the product of its degrees, 2 for
FSDP over all ranks) with the CI
settings of ``gefen_titan.validation.runs`` (``CI_SETTINGS``: 7 steps, global
batch 8 of local 2, checkpoint at step 4), through the same launcher as the
reshard validation, so equal runs are shared. The curve, the settings, the
tolerance and the library versions go to ``tests/reference_curves/<recipe>.json``;
``tests/integration/test_recipe_regression.py`` reruns each recipe and
compares. The tolerance it compares with is ``TOLERANCE`` here, in code: the
value in the files is for their readers, and a file whose value differs
fails the test (a loosened file cannot loosen the check).

Every run is pinned to torch's AVX2 CPU kernels (``PINNED_CPU_KERNELS``,
``ATEN_CPU_CAPABILITY=avx2``), which every x86 CI host runs: torch's AVX-512
kernels round otherwise, and the MoE recipes' routing amplifies the
difference past the tolerance within 7 steps (docs/validation.md, "Recipe
curves on every host"). A file records the kernels it was made under
(``cpu_kernels``, as torch names them); a run is compared only with a curve
made under the same kernels, and a host whose torch cannot run them says so
by name (``kernels_problem``) instead of comparing.

Run it when a change is meant to change training (the diff of the JSON
files shows by how much), never to make a failing regression test pass
without knowing why.
"""

from __future__ import annotations

import argparse
import json
import platform
from importlib import metadata
from pathlib import Path

from gefen_titan.recipe.files import read_recipe_tables
from gefen_titan.validation import launchers, recipes, runs

# The source checkout (recipes/ and tests/reference_curves/ live there).
ROOT = Path(__file__).resolve().parents[2]

CURVES = ROOT / "tests" / "reference_curves"

# Largest |loss - stored loss| accepted at any step. Measured here
# (docs/validation.md): two runs give identical curves to the 5 logged
# decimals; changing the order of the arithmetic (OMP_NUM_THREADS=2 instead
# of torchrun's 1: other GEMM blockings, as another CPU might pick) moved the
# curves by at most 2e-5 over the 7 steps. 2e-4 is 10x that, and below the
# smallest deliberate change seen: AdamW instead of Gefen for the norm
# weights alone (llama_gefen_mixed vs llama_gefen) moves step 2 by 4.8e-4.
TOLERANCE = 2e-4
# torch's CPU kernels of every curve run (ATEN_CPU_CAPABILITY): the set every x86 CI host has.
PINNED_CPU_KERNELS = "avx2"
SETTINGS_KEYS = ("steps_before", "steps_after", "global_batch", "local_batch")
# Shorter runs where no validation shares the reference run (its cache key holds the settings) and
# a step costs most: GefenMuon's bf16 Newton-Schulz on CPU (exact to gefen-x, so not reorderable)
# made these two 67 s and 42 s of the suite at 4 + 3 steps; 2 + 2 still trains on GefenMuon's state
# past its first step and saves at step 2. The stored curves record the settings they were made with.
SHORTER = {"llama_gefen_muon": {"steps_before": 2, "steps_after": 2},
           "llama_gefen_muon_hybrid": {"steps_before": 2, "steps_after": 2}}


def _fault_tolerant(recipe: Path) -> bool:
    return "fault_tolerance" in read_recipe_tables(str(recipe))


# The CPU recipe families: the Llama 3 ones and the mixture-of-experts ones
# (DeepSeek-V3 debug model, the small Qwen3 MoE: docs/moe.md).
CPU_GLOBS = ("llama_gefen*.toml", "dsv3_gefen*.toml", "qwen3_moe_gefen*.toml")


def _shipped_cpu() -> list[Path]:
    return sorted({r for pattern in CPU_GLOBS for r in (ROOT / "recipes").glob(pattern)})


def cpu_recipes() -> list[Path]:
    """The CPU recipes one torchrun trains (not the torchft ones: ``ft_recipes``)."""
    return [r for r in _shipped_cpu() if not _fault_tolerant(r)]


def ft_recipes() -> list[Path]:
    """The recipes with a [fault_tolerance] section: a lighthouse and replica groups run them
    (``tests/integration/test_fault_tolerance.py``, against their own uninterrupted run)."""
    return [r for r in _shipped_cpu() if _fault_tolerant(r)]


def nproc_of(recipe: Path) -> int:
    return recipes.recipe_world_size(str(recipe))


def settings_for(recipe: Path, stored: dict | None = None) -> runs.Settings:
    values = (stored or {}).get("settings", {**runs.CI_SETTINGS, **SHORTER.get(recipe.stem, {})})
    # The absolute path: the validation resolves recipes against the current directory.
    # The ranks forked from one server where they can be (validation.launchers: the same
    # run as torchrun's, without a fresh import per rank).
    launcher = "fork" if launchers.can_fork() is None else "torchrun"
    return runs.Settings(recipe=str(recipe), backend="gloo", launcher=launcher, cpu_kernels=PINNED_CPU_KERNELS,
                         **{k: values[k] for k in SETTINGS_KEYS})


def pinned_cpu_kernels() -> str:
    """The kernels the pinned runs get on this host, as torch names them (``AVX2`` on every x86 host with
    AVX2; what torch falls back to elsewhere)."""
    return launchers.torch_cpu_kernels(PINNED_CPU_KERNELS)


def ft_env() -> dict[str, str]:
    """The environment a torchft curve run's ranks add: the pinned kernels."""
    return {launchers.CPU_KERNELS_ENV: PINNED_CPU_KERNELS}


def kernels_problem(stored: dict, got: str) -> str | None:
    """Why a run under torch's ``got`` CPU kernels cannot be compared with ``stored``, or None. A curve is
    only compared with runs under the kernels it was made under: another set rounds otherwise."""
    made = stored.get("cpu_kernels")
    if made is None:
        return "the stored curve does not record the CPU kernels it was made under: regenerate it"
    if made != got:
        return (f"the stored curve was made under torch's {made} CPU kernels and this host's torch runs {got} "
                f"with ATEN_CPU_CAPABILITY={PINNED_CPU_KERNELS}: no curve for this host")
    return None


def recipe_name(recipe: Path) -> str:
    """The recipe as the stored files name it, ``recipes/<file>``."""
    return recipe.relative_to(ROOT).as_posix()


def run_recipe(recipe: Path, *, out: Path, cache: Path | None,
               stored: dict | None = None) -> tuple[runs.Settings, int, runs.Run]:
    settings = settings_for(recipe, stored)
    nproc = (stored or {}).get("nproc", nproc_of(recipe))
    run = runs.reference_run(settings, nproc, out=out / recipe.stem, cache=cache or out / "cache", quiet=True)
    return settings, nproc, run


def curve_path(recipe: Path) -> Path:
    return CURVES / f"{Path(recipe).stem}.json"


def ft_curve(recipe: str | Path) -> dict[int, dict[int, float]]:
    """A torchft recipe's stored curve: replica group -> step -> loss (each group logs its own)."""
    stored = json.loads(curve_path(Path(recipe)).read_text())
    assert stored["tolerance"] == TOLERANCE, f"{recipe}: stored tolerance {stored['tolerance']} != {TOLERANCE}"
    assert kernels_problem(stored, pinned_cpu_kernels()) is None, kernels_problem(stored, pinned_cpu_kernels())
    return {int(g): {int(s): v for s, v in losses.items()} for g, losses in stored["losses_by_group"].items()}


def _write_ft(recipe: Path, out: Path, check: bool) -> bool:
    """Run a torchft recipe uninterrupted (tests.helpers.ft_runs) and store or check its curve."""
    from tests.helpers import ft_runs

    run = ft_runs.uninterrupted(out / recipe.stem, recipe_name(recipe), env=ft_env())
    got = {g.replica: g.losses() for g in run.started}
    if check:
        problems = [p for g, losses in ft_curve(recipe).items() for p in compare({"losses": losses}, got[g])[1]]
        print(f"{recipe.stem} (2 groups x 2 procs): {'; '.join(problems) or 'ok'}")
        return bool(problems)
    data = {
        "recipe": recipe_name(recipe),
        "groups": 2, "nproc_per_group": 2, "steps": ft_runs.steps_of(recipe_name(recipe)),
        "command": f"lighthouse + 2 x torchrun --nproc_per_node=2 train.py --job.config {recipe_name(recipe)} "
                   f"--training.steps {ft_runs.steps_of(recipe_name(recipe))} " + " ".join(ft_runs.SETTINGS)
                   + " --fault_tolerance.min_replica_size 2 --fault_tolerance.replica_id {0,1}"
                   " (tests/helpers/ft_runs.py)",
        "tolerance": TOLERANCE,
        "cpu_kernels": pinned_cpu_kernels(),
        "losses_by_group": {str(g): {str(s): v for s, v in sorted(losses.items())} for g, losses in got.items()},
        "generated_with": versions(),
    }
    CURVES.mkdir(parents=True, exist_ok=True)
    curve_path(recipe).write_text(json.dumps(data, indent=1) + "\n")
    print(f"{recipe.stem}: -> {curve_path(recipe).relative_to(ROOT)}")
    return False


def compare(stored: dict, losses: dict[int, float]) -> tuple[float, list[str]]:
    """(max |deviation|, problems) of a new curve against a stored one,
    within ``TOLERANCE`` (never the file's own ``tolerance``)."""
    ref = {int(k): v for k, v in stored["losses"].items()}
    problems = []
    if sorted(losses) != sorted(ref):
        problems.append(f"steps {sorted(losses)} != stored {sorted(ref)}")
    dev = max((abs(losses[s] - ref[s]) for s in ref if s in losses), default=float("inf"))
    if dev > TOLERANCE:
        worst = max((s for s in ref if s in losses), key=lambda s: abs(losses[s] - ref[s]))
        problems.append(f"max |loss - stored| {dev:.2e} > tolerance {TOLERANCE:g} "
                        f"(step {worst}: {losses[worst]:.5f} vs stored {ref[worst]:.5f})")
    return dev, problems


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "machine": platform.machine()}
    for dist in ("torch", "torchtitan", "gefen-x"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "?"
    return out


def drift(recipes: list[Path], kernels: str, optimizer: str | None, out: Path) -> None:
    """Each recipe's curve under the pinned kernels and under ``kernels`` (``host``: this host's own), with
    ``optimizer`` in place of the recipe's: the losses side by side and the largest |difference| (what a
    curve made on one kind of host can promise on another; docs/validation.md). Writes no curve."""
    other = None if kernels == "host" else kernels
    for recipe in recipes:
        curves = {}
        for pin in (PINNED_CPU_KERNELS, other):
            settings = settings_for(recipe)
            settings.cpu_kernels = pin
            if optimizer:
                settings.extra = ["--optimizer.name", optimizer]
            run = runs.reference_run(settings, nproc_of(recipe), out=out / f"drift-{recipe.stem}-{pin or 'host'}",
                                     quiet=True)
            curves[settings.torch_cpu_kernels()] = run.losses
        (a, la), (b, lb) = list(curves.items())[0], list(curves.items())[-1]
        diffs = {s: abs(la[s] - lb[s]) for s in la if s in lb}
        print(f"{recipe.stem} ({optimizer or 'its optimizer'}): {a} vs {b}")
        for s in sorted(diffs):
            print(f"  step {s}: {la[s]:.5f} {lb[s]:.5f}  |diff| {diffs[s]:.2e}")
        print(f"  max |diff| {max(diffs.values(), default=0.0):.2e} (tolerance {TOLERANCE:g})", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", help="comma-separated recipe names (default: every CPU recipe, CPU_GLOBS)")
    ap.add_argument("--check", action="store_true", help="compare with the stored curves; write nothing")
    ap.add_argument("--out", default="outputs/reference_curves", help="folder for the runs")
    ap.add_argument("--reference-cache", help="share runs with validate_reshard.py runs kept here")
    ap.add_argument("--drift", metavar="KERNELS",
                    help="print each recipe's curve under the pinned CPU kernels and under KERNELS (an "
                         "ATEN_CPU_CAPABILITY value, or 'host': this host's own) and their difference; write nothing")
    ap.add_argument("--optimizer", help="with --drift: --optimizer.name for the runs (e.g. AdamW)")
    args = ap.parse_args(argv)

    recipes, ft = cpu_recipes(), ft_recipes()
    if args.recipes:
        wanted = {n.strip().removesuffix(".toml") for n in args.recipes.split(",")}
        recipes, ft = [r for r in recipes if r.stem in wanted], [r for r in ft if r.stem in wanted]
        if missing := wanted - {r.stem for r in recipes + ft}:
            raise SystemExit(f"not CPU recipes: {sorted(missing)}")
    out = Path(args.out).resolve()
    if args.drift:
        drift(recipes, args.drift, args.optimizer, out)
        return 0
    cache = Path(args.reference_cache).resolve() if args.reference_cache else None
    failed = False
    for recipe in ft:
        failed |= _write_ft(recipe, out, args.check)
    for recipe in recipes:
        stored = json.loads(curve_path(recipe).read_text()) if curve_path(recipe).exists() else None
        if args.check and stored is None:
            print(f"{recipe.stem}: no stored curve ({curve_path(recipe)})")
            failed = True
            continue
        settings, nproc, run = run_recipe(recipe, out=out, cache=cache, stored=stored if args.check else None)
        curve = " ".join(f"{run.losses[s]:.5f}" for s in sorted(run.losses))
        if args.check:
            if why := kernels_problem(stored, settings.torch_cpu_kernels()):
                print(f"{recipe.stem}: {why}")
                failed = True
                continue
            dev, problems = compare(stored, run.losses)
            failed |= bool(problems)
            print(f"{recipe.stem} ({nproc} procs): max |dev| {dev:.2e}  {'; '.join(problems) or 'ok'}")
            continue
        data = {
            "recipe": recipe_name(recipe),
            "nproc": nproc,
            "settings": {k: getattr(settings, k) for k in SETTINGS_KEYS},
            "command": f"torchrun --nproc_per_node={nproc} train.py --job.config {recipe_name(recipe)} "
                       + " ".join(settings.overrides(nproc)),
            "tolerance": TOLERANCE,
            "cpu_kernels": settings.torch_cpu_kernels(),
            "losses": {str(s): run.losses[s] for s in sorted(run.losses)},
            "generated_with": versions(),
        }
        CURVES.mkdir(parents=True, exist_ok=True)
        curve_path(recipe).write_text(json.dumps(data, indent=1) + "\n")
        note = ""
        if stored is not None:
            dev, _ = compare(stored, run.losses)
            note = f" (max change {dev:.2e})"
        print(f"{recipe.stem} ({nproc} procs): {curve} -> {curve_path(recipe).relative_to(ROOT)}{note}")
    return 1 if failed else 0

