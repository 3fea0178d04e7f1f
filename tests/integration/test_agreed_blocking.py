"""Agreed blocking: the Gefen state is a function of the model, not of the mesh.

Real Gefen on a small model under real FSDP2 / TP / HSDP / pipeline layouts
on gloo (``agreed_worker.py``), every layout fed bit-identical global
gradients:

* layout invariance: after 3 steps the state (codes, magnitudes, ``vmean``,
  periods, codebook) and the parameters are bit-identical at W=1, 2, 3
  (uneven rows, an empty shard), 4, FSDP 2 x TP 2, TP 2, HSDP 2 x 2 and
  2 pipeline stages (x FSDP 2);
* the reshard matrix through GefenCheckpointManager (format v3): the loaded
  global state is bit-identical to the saved one, and the parameters after 2
  more steps equal the uninterrupted run at the target layout, bit for bit;
* fail closed: bad v3 checkpoints, a layout the periods do not fit, a
  ``deterministic`` or blocking mismatch, ranks that disagree at save time.

The jobs are ``tests.helpers.agreed_runs``'s plan: five launches (one per
world size, 2 twice), several jobs each (``worker_jobs``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from gefen_titan.checkpoint.format.schema import grid_shape
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.block_periods import BlockingError, candidate_periods, row_unit
from gefen_titan.optim.block_stats import histogram
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen.options import GefenOptions
from tests.helpers import agreed_runs, worker_jobs
from tests.helpers.agreed_runs import PAIRS, RUNS, target
from tests.helpers.bad_checkpoints import V2_CASES, v2_case_key


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
    (optim,) = opt.optimizers_of("Gefen")
    for name, p, _ in gx.named_params(optim):
        st = gx.gefen_read(optim, p)
        assert st.step == 1
        if p.dim() == 1:
            assert st.period == 1
        else:
            assert p.shape[-1] % st.period == 0 and st.period >= 8, (name, st.period)
    assert gx.codebook(optim) is not None


def test_parameter_without_gradient_refused_before_any_change():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = _container(model)
    model[0](torch.randn(2, 64)).sum().backward()  # model[1] gets no gradient
    with pytest.raises(BlockingError, match="no gradient on the first step"):
        opt.step()
    (optim,) = opt.optimizers_of("Gefen")
    assert gx.codebook(optim) is None
    assert all(gx.period(optim, p) is None for _, p, _ in gx.named_params(optim))


@pytest.mark.parametrize("kw, match", [
    (lambda: {"gefen": GefenOptions(codebook_refresh_every=10)}, "optimizer.gefen.codebook_refresh_every > 0"),
    (lambda: {"gefen": GefenOptions(force_1d_period_one=False)}, "optimizer.gefen.force_1d_period_one = false"),
    (lambda: {"blocking": BlockingOptions(max_tensor_parallel_degree=0)}, "max_tensor_parallel_degree"),
    (lambda: {"blocking": BlockingOptions(mode="global")}, "blocking"),
])
def test_recipes_that_would_break_agreement_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        GefenOptimizersContainer.Config(name="Gefen", **kw())


def test_per_rank_blocking_keeps_gefens_own_learning():
    """The opt-out accepts what agreed blocking refuses and installs no agreement hook."""
    model = nn.Linear(64, 64)
    opt = _container(model, blocking=BlockingOptions(mode="per_rank"), gefen=GefenOptions(codebook_refresh_every=5))
    assert opt.blocking == "per_rank" and opt.agreement is None
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    (optim,) = opt.optimizers_of("Gefen")
    # gefen-x learned them itself, on its own step.
    assert gx.codebook(optim) is not None and gx.period(optim, model.weight) is not None


def test_capturable_refused_at_construction():
    with pytest.raises(ValueError, match="capturable"):
        GefenOptimizersContainer.Config(
            name="Gefen", optimizer_factory_kwargs_by_name={"Gefen": {"capturable": True}}
        ).build(model_parts=[nn.Linear(8, 8)])


# ------------------------------------------------------------------ layouts
load = worker_jobs.rank_dumps


@pytest.fixture(scope="module")
def agreed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Every job of ``agreed_runs.PLAN``: (base folder, outputs, bad checkpoints)."""
    return worker_jobs.launched(tmp_path_factory.mktemp("agreed"), agreed_runs.plan)


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


@pytest.mark.parametrize("tag", ["fsdp2", "fsdp2_offload", "fsdp3", "fsdp4", "fsdp_tp4", "tp2", "hsdp4", "pp2", "pp4"])
def test_state_is_bit_identical_at_every_layout(agreed, tag):
    _, out, _ = agreed
    one, other = _ref(out, "fsdp1"), _ref(out, tag)
    assert _equal_state(one["state"], other["state"]) == []
    assert _records(one["state"]) == _records(other["state"])
    for s, ps in one["params"].items():
        for name, p in ps.items():
            assert torch.equal(p, other["params"][s][name]), (tag, s, name)


def test_the_state_is_quantized_and_compact(agreed):
    _, out, _ = agreed
    ref = _ref(out, "fsdp1")["state"]
    periods = ref["periods"]
    assert all(p > 1 for n, p in periods.items() if "norm" not in n)
    # uneven rows and an empty shard were really exercised
    assert ref[gefen_keys.qcodes_key("gate.weight")].shape == (2, 64)
    state_bytes, numel = load(out, "fsdp1")[0]["ref"]["bytes"]
    assert 1.0 < state_bytes / numel < 1.6


@pytest.mark.parametrize("src, tgt", PAIRS)
def test_reshard_matrix_is_bit_exact(agreed, src, tgt):
    _, out, _ = agreed
    resume_tag = next(tag for _, _, tag, _, loads in RUNS if src in loads and target(tag) == tgt)
    saved = _ref(out, src.removeprefix("c_"))
    loaded = merged(load(out, resume_tag), "resume", src)
    uninterrupted = _ref(out, tgt)
    assert _equal_state(saved["state"], loaded["state"]) == []
    assert _records(saved["state"]) == _records(loaded["state"])
    for s, ps in loaded["params"].items():
        for name, p in ps.items():
            assert torch.equal(p, uninterrupted["params"][s][name]), (src, tgt, s, name)


# -------------------------------------------------------------- fail closed
@pytest.fixture(scope="module")
def bad(agreed):
    _, out, root = agreed
    return load(out, "bad"), load(out, "misfit"), root


@pytest.mark.parametrize("name", sorted(V2_CASES))
def test_bad_v2_checkpoint_fails_closed_on_every_rank(bad, name):
    ranks, _, _ = bad
    _assert_closed([r["cases"][v2_case_key(name)] for r in ranks], V2_CASES[name][3])


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
