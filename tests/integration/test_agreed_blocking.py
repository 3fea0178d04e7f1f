"""Agreed blocking: the Gefen state is a function of the model, not of the mesh.

Real Gefen on a small model under real FSDP2 / TP / HSDP / pipeline layouts
on gloo (``agreed_worker.py``), every layout fed bit-identical global
gradients:

* layout invariance: after 3 steps the state (codes, magnitudes, ``vmean``,
  periods, codebook) and the parameters are bit-identical at W=1, 2, 3
  (uneven rows, an empty shard), 4, FSDP 2 x TP 2, TP 2, HSDP 2 x 2 and
  2 pipeline stages (x FSDP 2);
* the reshard matrix through GefenCheckpointManager (format v2): the loaded
  global state is bit-identical to the saved one, and the parameters after 2
  more steps equal the uninterrupted run at the target layout, bit for bit;
* fail closed: bad v2 checkpoints, a layout the periods do not fit, a
  ``deterministic`` or blocking mismatch, ranks that disagree at save time.

Five torchrun launches (PLAN: one per world size, 2 twice) run all these
jobs, each launch several in turn in one process group (``worker_jobs``).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from gefen_titan.checkpoint.schema import grid_shape
from gefen_titan.optim import gefen_state as gs
from gefen_titan.optim.blocking import BlockingError, candidate_periods, histogram, row_unit
from gefen_titan.optim.container import GefenOptimizersContainer
from tests.helpers import worker_jobs

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.helpers.agreed_worker"
S, K = 3, 2
_port = [29720]


# ------------------------------------------------------------ single process
def test_row_unit_and_candidates():
    w = torch.empty(256, 192)
    assert row_unit("w", w) == 192
    assert row_unit("w", w, max_tp_degree=2) == 96
    assert row_unit("w", w, max_tp_degree=4) == 48
    # TP 3 would cut columns at 64 and 128; TP degrees dividing 6 are 2, 3, 6.
    assert row_unit("w", w, max_tp_degree=6) == math.gcd(96, 64, 32)
    assert candidate_periods(12) == [1, 2, 3, 4, 6, 12]
    assert grid_shape((256, 192), 32) == (256, 6)
    assert grid_shape((7,), 1) == (7,)
    with pytest.raises(ValueError):
        grid_shape((4, 6), 4)


def test_histogram_matches_gefens_learner():
    """Same periods in, same codebook out as gefen-x's own learner."""
    from gefen.gefen import learn_gefen_exact_codebook_from_grad_periods

    from gefen_titan.optim.codebook_solver import codebook_from_counts

    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(300, 96), nn.Linear(96, 160), nn.LayerNorm(160), nn.Linear(160, 300))
    x = torch.randint(300, (8, 24))
    model(x).logsumexp(-1).mean().backward()
    periods = {"0.weight": 32, "1.weight": 96, "1.bias": 1, "2.weight": 1, "2.bias": 1, "3.weight": 160, "3.bias": 1}
    grads = [(n, p.grad.reshape(-1), periods[n], p.grad) for n, p in model.named_parameters()]
    theirs = learn_gefen_exact_codebook_from_grad_periods(
        grad_periods=iter(grads), codebook_device=torch.device("cpu"), num_codebooks=256,
        force_endpoints=True, verbose=False, compute_mse_logging=False, use_fused_histogram=False)
    counts = sum(histogram(g, p) for _, g, p, _ in grads)
    ours = codebook_from_counts(counts)
    assert int((counts > 0).sum()) > 256  # the DP path, not the padded one
    assert torch.equal(ours, theirs)


def _container(model, **kw):
    return GefenOptimizersContainer.Config(name="Gefen", lr=1e-2, **kw).build(model_parts=[model])


def test_single_process_agreed_step_presets_what_gefen_would_learn(monkeypatch):
    import gefen.quantization

    def forbidden(*a, **k):
        raise AssertionError("gefen-x's numba codebook solver ran")

    monkeypatch.setattr(gefen.quantization, "exact_dp", forbidden)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 128), nn.Linear(128, 384), nn.RMSNorm(384), nn.Linear(384, 512))
    opt = _container(model)
    model(torch.randint(512, (4, 16))).square().mean().backward()
    opt.step()
    (optim,) = opt.gefen_optimizers
    for name, p, _ in gs.named_params(optim):
        st = gs.read(optim, p)
        assert st.step == 1
        if p.dim() == 1:
            assert st.period == 1
        else:
            assert p.shape[-1] % st.period == 0 and st.period >= 8, (name, st.period)
    assert gs.codebook(optim) is not None


def test_parameter_without_gradient_refused_before_any_change():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = _container(model)
    model[0](torch.randn(2, 64)).sum().backward()  # model[1] gets no gradient
    with pytest.raises(BlockingError, match="no gradient on the first step"):
        opt.step()
    (optim,) = opt.gefen_optimizers
    assert gs.codebook(optim) is None
    assert all(gs.period(optim, p) is None for _, p, _ in gs.named_params(optim))


@pytest.mark.parametrize("kw, match", [
    ({"codebook_refresh_every": 10}, "codebook_refresh_every"),
    ({"force_1d_period_one": False}, "force_1d_period_one"),
    ({"max_tensor_parallel_degree": 0}, "max_tensor_parallel_degree"),
    ({"blocking": "global"}, "blocking"),
])
def test_recipes_that_would_break_agreement_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        GefenOptimizersContainer.Config(name="Gefen", **kw)


def test_per_rank_blocking_keeps_gefens_own_learning():
    """The opt-out accepts what agreed blocking refuses and installs no agreement hook."""
    model = nn.Linear(64, 64)
    opt = _container(model, blocking="per_rank", codebook_refresh_every=5)
    assert opt.blocking == "per_rank" and opt._agreement is None
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    (optim,) = opt.gefen_optimizers
    # gefen-x learned them itself, on its own step.
    assert gs.codebook(optim) is not None and gs.period(optim, model.weight) is not None


def test_capturable_refused_at_construction():
    with pytest.raises(ValueError, match="capturable"):
        GefenOptimizersContainer.Config(
            name="Gefen", optimizer_factory_kwargs_by_name={"Gefen": {"capturable": True}}
        ).build(model_parts=[nn.Linear(8, 8)])


# ------------------------------------------------------------------ layouts
def launch(nproc: int, *jobs: list[str]) -> None:
    """One torchrun launch of the worker running ``jobs`` in order."""
    _port[0] += 1
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master-port={_port[0]}", "-m", WORKER, *worker_jobs.chain(*jobs)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


def job(layout: str, tag: str, out: Path, *args: str) -> list[str]:
    return ["--layout", layout, "--tag", tag, "--out", str(out), "--save-step", str(S), "--steps", str(K), *args]


def load(out: Path, tag: str) -> list[dict]:
    ranks = sorted(out.glob(f"{tag}_r[0-9]*.pt"), key=lambda p: int(p.stem.rsplit("_r", 1)[1]))
    return [torch.load(p, weights_only=False) for p in ranks]


def merged(ranks: list[dict], kind: str, src: str | None = None) -> dict:
    """The global picture over all stages; ranks of a stage must agree."""
    state, params = {}, {}
    for r in ranks:
        res = r["ref"] if kind == "ref" else r["resume"][src]
        for key, value in res["state"].items():
            if key == "periods":
                state.setdefault(key, {}).update(value)
                continue
            if key in state:
                same = torch.equal(state[key], value) if isinstance(value, torch.Tensor) else state[key] == value
                assert same or key.startswith("gefen/optimizer/"), f"ranks disagree on {key}"
            state[key] = value
        for s, ps in res["params"].items():
            params.setdefault(s, {}).update(ps)
    # Optimizer records are per stage (their own parameters): compare content.
    return {"state": state, "params": params}


# (layout, nproc, tag, ref base, loads): one worker job each
RUNS = [
    ("fsdp", 2, "fsdp2", "c_fsdp2", []),
    ("fsdp", 4, "fsdp4", "c_fsdp4", ["c_fsdp2"]),
    ("fsdp", 3, "fsdp3", "c_fsdp3", ["c_fsdp2"]),
    ("fsdp", 1, "fsdp1", "c_fsdp1", ["c_fsdp2"]),
    ("fsdp_tp", 4, "fsdp_tp4", "c_fsdp_tp4", ["c_fsdp2"]),
    ("tp", 2, "tp2", "c_tp2", ["c_fsdp_tp4"]),
    ("hsdp", 4, "hsdp4", "c_hsdp4", []),
    ("pp", 2, "pp2", "c_pp2", []),
    ("pp", 4, "pp4", "c_pp4", ["c_fsdp2"]),
    ("fsdp", 2, "fsdp2_resume", "", ["c_fsdp2", "c_fsdp4", "c_fsdp3", "c_fsdp1", "c_fsdp_tp4", "c_hsdp4", "c_pp2"]),
    ("fsdp", 4, "fsdp4_resume", "", ["c_fsdp_tp4"]),
]
PAIRS = [(src, tag.split("_resume")[0]) for _, _, tag, _, loads in RUNS for src in loads]

# The launches: torchrun's start-up is most of a launch's cost, so the jobs
# of one world size share one where the order allows. A job's loads must be
# saved by an earlier launch or an earlier job of its own; "v1", "notp",
# "misfit" and "bad" are the fail-closed jobs (`bad` below), and the bad
# checkpoints "bad" tries are edited, between launches, from c_fsdp2 and
# c_pp2.
PLAN = [
    (2, ["fsdp2", "pp2", "v1", "notp", "misfit"]),
    (4, ["fsdp4", "fsdp_tp4", "hsdp4", "pp4", "fsdp4_resume"]),
    (3, ["fsdp3"]),
    (1, ["fsdp1"]),
    (2, ["tp2", "fsdp2_resume", "bad"]),
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every job of PLAN, launched in order: (base, out, bad checkpoints' root)."""
    base = tmp_path_factory.mktemp("agreed")
    out, root = base / "out", base / "bad"
    out.mkdir()
    root.mkdir()
    jobs = {}
    for layout, n, tag, ref, loads in RUNS:
        args = []
        if ref:
            args += ["--ref", str(base / ref)]
        if loads:
            args += ["--load", ",".join(str(base / c) for c in loads)]
        jobs[tag] = (n, job(layout, tag, out, *args))
    # A per-rank (format v1) checkpoint, one whose periods assume no TP (a TP
    # layout then tries it), and every bad checkpoint of CASES.
    jobs["v1"] = (2, job("fsdp", "v1", out, "--ref", str(base / "c_v1"), "--blocking", "per_rank", "--steps", "0"))
    jobs["notp"] = (2, job("fsdp", "notp", out, "--ref", str(root / "c_notp"), "--max-tp", "1", "--steps", "0"))
    jobs["misfit"] = (2, job("tp", "misfit", out, "--cases", str(root / "c_notp")))
    for n, tags in PLAN:
        if "bad" in tags:
            cases = _write_bad_checkpoints(base, root)
            jobs["bad"] = (2, job("fsdp", "bad", out, "--cases", ",".join(cases),
                                  "--tamper-save", str(root / "c_tampered")))
        assert all(jobs[t][0] == n for t in tags), (n, tags)
        launch(n, *(jobs[t][1] for t in tags))
    assert set(jobs) == {t for _, tags in PLAN for t in tags}, "a job that PLAN does not launch"
    return base, out, root


@pytest.fixture(scope="module")
def runs(launched):
    base, out, _ = launched
    return base, out


def _ref(out, tag):
    return merged(load(out, tag), "ref")


def _equal_state(a: dict, b: dict) -> list[str]:
    bad = []
    for state in (a, b):  # one codebook per stage's optimizer, all the job's one
        for key in [k for k in state if k.startswith("gefen/codebook/")]:
            if not torch.equal(state[key], state["codebook"]):
                bad.append(key)
    for key in sorted(set(a) | set(b)):
        if key.startswith(("gefen/optimizer/", "gefen/codebook/")):
            continue  # per stage: compared through the records and the codebook
        va, vb = a.get(key), b.get(key)
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            ok = va.dtype == vb.dtype and torch.equal(va, vb)
        else:
            ok = va == vb
        if not ok:
            bad.append(key)
    return bad


def _records(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if key.startswith("gefen/optimizer/"):
            for rec in json.loads(value)["params"]:
                out[rec["fqn"]] = rec
    return out


@pytest.mark.parametrize("tag", ["fsdp2", "fsdp3", "fsdp4", "fsdp_tp4", "tp2", "hsdp4", "pp2", "pp4"])
def test_state_is_bit_identical_at_every_layout(runs, tag):
    _, out = runs
    one, other = _ref(out, "fsdp1"), _ref(out, tag)
    assert _equal_state(one["state"], other["state"]) == []
    assert _records(one["state"]) == _records(other["state"])
    for s, ps in one["params"].items():
        for name, p in ps.items():
            assert torch.equal(p, other["params"][s][name]), (tag, s, name)


def test_the_state_is_quantized_and_compact(runs):
    _, out = runs
    ref = _ref(out, "fsdp1")["state"]
    periods = ref["periods"]
    assert all(p > 1 for n, p in periods.items() if "norm" not in n)
    # uneven rows and an empty shard were really exercised
    assert ref["gefen/codes/gate.weight"].shape == (2, 64)
    state_bytes, numel = load(out, "fsdp1")[0]["ref"]["bytes"]
    assert 1.0 < state_bytes / numel < 1.6


@pytest.mark.parametrize("src, tgt", PAIRS)
def test_reshard_matrix_is_bit_exact(runs, src, tgt):
    _, out = runs
    resume_tag = next(tag for _, _, tag, _, loads in RUNS if src in loads and tag.split("_resume")[0] == tgt)
    saved = _ref(out, src.removeprefix("c_"))
    loaded = merged(load(out, resume_tag), "resume", src)
    uninterrupted = _ref(out, tgt)
    assert _equal_state(saved["state"], loaded["state"]) == []
    assert _records(saved["state"]) == _records(loaded["state"])
    for s, ps in loaded["params"].items():
        for name, p in ps.items():
            assert torch.equal(p, uninterrupted["params"][s][name]), (src, tgt, s, name)


# -------------------------------------------------------------- fail closed
def _edited(src: Path, dst: Path, edit) -> None:
    full = dst.parent / (dst.name + ".pt")
    dcp_to_torch_save(str(src / "ckpt" / f"step-{S}"), str(full))
    sd = torch.load(full, weights_only=False)
    edit(sd["optimizer"])
    torch.save(sd, full)
    torch_save_to_dcp(str(full), str(dst / "ckpt" / f"step-{S}"))


def _set(key, fn):
    def edit(opt):
        opt[key] = fn(opt[key])
    return edit


def _set_record(fqn, field, value):
    def edit(opt):
        for key in [k for k in opt if k.startswith("gefen/optimizer/")]:
            rec = json.loads(opt[key])
            for p in rec["params"]:
                if p["fqn"] == fqn:
                    p[field] = value
            opt[key] = json.dumps(rec)
    return edit


def _nudged(cb):
    cb = cb.clone()
    cb[100] = (cb[99] + cb[100]) / 2
    return cb


# name -> (source checkpoint, edit or None, config overrides, expected text)
CASES = {
    "grid_missing": ("c_fsdp2", lambda o: o.pop("gefen/vmean/layers.0.w1.weight"), "", "missing from the checkpoint"),
    "grid_corrupt": ("c_fsdp2", _set("gefen/magnitude/output.weight", lambda v: v.fill_(float("nan"))), "",
                     "non-finite"),
    "grid_shape": ("c_fsdp2", _set("gefen/vmean/output.weight", lambda v: v[:, :1].clone()), "", "expected"),
    "counters": ("c_fsdp2", _set_record("layers.1.w2.weight", "vmean_step", 99), "", "counters do not add up"),
    "codebook_corrupt": ("c_fsdp2", _set("gefen/codebook/tok_embeddings.weight", lambda v: v.flip(0)), "",
                         "is corrupt"),
    "codebooks_disagree": ("c_pp2", _set("gefen/codebook/layers.1.norm.weight", _nudged), "", "codebooks disagree"),
    "deterministic": ("c_fsdp2", None, "|deterministic=1", "optimizer.deterministic"),
    "blocking": ("c_fsdp2", None, "|blocking=per_rank", 'optimizer.blocking = "agreed"'),
    "v1_into_agreed": ("c_v1", None, "", 'optimizer.blocking = "per_rank"'),
    "truncated": ("c_fsdp2", "truncate", "", "cannot read"),
}


def _write_bad_checkpoints(base: Path, root: Path) -> list[str]:
    """The bad checkpoints of CASES under ``root`` (from the saved ones in
    ``base``), as the worker's ``--cases``."""
    cases = []
    for name, (src, edit, overrides, _) in CASES.items():
        if edit is None:
            cases.append(f"{base / src}{overrides}")
            continue
        dst = root / name
        if edit == "truncate":
            shutil.copytree(base / src, dst)
            f = dst / "ckpt" / f"step-{S}" / "__1_0.distcp"
            f.write_bytes(f.read_bytes()[:1000])
        else:
            _edited(base / src, dst, edit)
        cases.append(f"{dst}{overrides}")
    return cases


@pytest.fixture(scope="module")
def bad(launched):
    _, out, root = launched
    return load(out, "bad"), load(out, "misfit"), root


def _key(name):
    src, edit, overrides, _ = CASES[name]
    return (src if edit is None else name) + overrides.replace("|", "")


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_v2_checkpoint_fails_closed_on_every_rank(bad, name):
    ranks, _, _ = bad
    _assert_closed([r["cases"][_key(name)] for r in ranks], CASES[name][3])


def _assert_closed(got: list[dict], expected: str) -> None:
    for g in got:
        assert g["error"] is not None, "the load succeeded"
        assert "GefenCheckpointError" in g["error"], g["error"]
        assert expected in g["error"], g["error"]
        for key, before in g["before"].items():
            after = g["after"][key]
            if isinstance(before, tuple):
                assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                           for a, b in zip(before, after)), f"live {key} changed by a failed load"
            else:
                assert (torch.equal(before, after) if isinstance(before, torch.Tensor) else before == after), key
    assert len({g["error"] for g in got}) == 1, "ranks raised different errors"


def test_periods_that_do_not_fit_the_layout_are_refused(bad):
    _, misfit, root = bad
    _assert_closed([r["cases"]["c_notp"] for r in misfit], "max_tensor_parallel_degree")


def test_save_refused_when_ranks_disagree(bad):
    ranks, _, root = bad
    for r in ranks:
        assert r["tamper"] is not None and "ranks disagree" in r["tamper"], r["tamper"]
    assert not list((root / "c_tampered").rglob("*.distcp")), "a refused save wrote data"
