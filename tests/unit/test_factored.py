"""The factored second moment's pieces on one process: exact axis sums, the step against gefen-x's own
factored step, its records and option checks. Its layouts and reshards: tests/integration/test_factored.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from gefen_titan.checkpoint.format import schema
from gefen_titan.optim import axis_sums
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.blocking_options import BlockingOptions
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen.options import GefenOptions
from gefen_titan.optim.kinds.gefen.records import OptimizerRecord, ParamRecord

GROUP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}


# ------------------------------------------------------------------ exact sums
def _split_sums(x: torch.Tensor, dim: int, cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums of ``x`` along ``dim`` computed per part (cut at ``cuts``) and added, as ranks would."""
    parts = torch.tensor_split(x, cuts, dim=dim)
    codes = torch.stack([axis_sums.exponents(p, dim) for p in parts]).amax(dim=0)
    n = x.shape[dim]
    return sum(axis_sums.sums(p, dim, codes, n) for p in parts), codes


@pytest.mark.parametrize("dim", [0, 1])
def test_axis_sums_are_the_same_integers_for_every_split(dim):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 53, generator=gen) ** 3 * torch.rand(37, 1, generator=gen) * 1e-2).square()
    x[3] *= 1e-30  # a row far below the others keeps its own grid
    whole, codes = _split_sums(x, dim, [])
    for cuts in ([5], [1, 2, 30], [x.shape[dim] - 1], [10, 10, 20]):  # an empty part too
        parts, codes2 = _split_sums(x, dim, cuts)
        assert torch.equal(codes, codes2) and torch.equal(parts, whole), cuts
    # ... and they are the sums: below the exact sum by less than n * 2^(e - F) (flooring), plus fp64's
    # rounding of the result; relative to the sum, under n^2 * 2^-61.
    n = x.shape[dim]
    got = axis_sums.values(whole, codes, n)
    slices = x.double().movedim(dim, -1).tolist()
    exact = torch.tensor([math.fsum(s) for s in slices], dtype=torch.float64)
    assert bool(((exact - got).abs() <= exact * (n * n * 2.0 ** -61 + 2.0 ** -52)).all())
    assert float(((exact - got).abs() / exact).max()) < 2.0 ** -40


def test_float_sums_would_depend_on_the_split():
    """What the fixed point is for: fp32 partial sums added over ranks change with the cut."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4096, generator=gen) ** 3).square()
    splits = [[1000], [7, 3001], [2048], [1, 2, 3, 4000], [333, 666, 999]]
    floats = {float(sum(part.sum() for part in torch.tensor_split(x, cuts))) for cuts in splits}
    assert len(floats) > 1, floats
    exact = {tuple(_split_sums(x.view(1, -1), 1, cuts)[0].flatten().tolist()) for cuts in splits}
    assert len(exact) == 1


def test_a_slice_of_n_values_cannot_overflow():
    """n values at the top of the grid add up below 2^62 whatever n is (F shrinks with n)."""
    for n in (1, 2, 3, 1000, 1 << 17, (1 << 20) + 1):
        x = torch.full((1, n), 3.0e38)  # the largest grad² (frexp exponent 128)
        codes = axis_sums.exponents(x, 1)
        total = axis_sums.sums(x, 1, codes, n)
        assert 0 < int(total) < 1 << 62, n
        assert math.isclose(float(axis_sums.values(total, codes, n)), 3.0e38 * n, rel_tol=n * n * 2.0 ** -61 + 1e-7)


def test_axis_sums_of_zeros_and_of_a_nonfinite_slice():
    x = torch.zeros(3, 4)
    x[1, 2] = float("inf")
    x[2] = 0.25
    codes = axis_sums.exponents(x, 1)
    assert codes.dtype == torch.uint8 and int(codes[1]) == axis_sums.NONFINITE
    got = axis_sums.values(axis_sums.sums(x, 1, codes, 4), codes, 4)
    assert got[0] == 0 and math.isnan(got[1]) and got[2] == 1.0
    empty = axis_sums.exponents(torch.zeros(3, 0), 1)
    assert empty.tolist() == [axis_sums.NO_DATA] * 3


# ------------------------------------------------------------------ the step
def _run(second_moment: str | None, shape=(64, 48), steps=5):
    """Five steps of one matrix and one vector: gefen-titan's Gefen (``second_moment``) or, for None,
    gefen-x's own factored Gefen (``factored_v_2d=True``), from the same codebook and periods."""
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(*shape)), nn.Parameter(torch.randn(shape[-1]))
    if second_moment is None:
        optim = gx.new_gefen([{"params": [("w", w), ("b", b)], "lr": GROUP["lr"], "weight_decay": 0.1}],
                             betas=(0.9, 0.95), eps=1e-8, fused=False, factored_v_2d=True)
    else:
        model = nn.Module()
        model.w, model.b = w, b
        opt = GefenOptimizersContainer.Config(name="Gefen", lr=GROUP["lr"], weight_decay=0.1, betas=(0.9, 0.95),
                                              eps=1e-8,
                                              gefen=GefenOptions(second_moment=second_moment)
                                              ).build(model_parts=[model])
        opt.agreement = None  # the codebook and periods below, as the agreement would set them
        (optim,) = opt.optimizers_of("Gefen")
    gen = torch.Generator().manual_seed(1)
    codebook = torch.sort(torch.rand(256, generator=gen) * 2 - 1).values
    codebook[0], codebook[-1] = -1.0, 1.0
    gx.set_codebook(optim, codebook)
    gx.set_period(optim, w, shape[-1])
    gx.set_period(optim, b, 1)
    for _ in range(steps):
        w.grad = torch.randn(*shape, generator=gen) * 1e-2
        b.grad = torch.randn(shape[-1], generator=gen) * 1e-2
        optim.step()
    return w.detach().clone(), b.detach().clone(), optim, w, b


def test_the_step_is_gefen_xs_factored_step_but_for_the_exact_sums():
    w, b, optim, pw, pb = _run("factored")
    w_x, b_x, optim_x, pw_x, _ = _run(None)
    ours, theirs = gx.gefen_read(optim, pw), optim_x.state[pw_x]
    assert ours.factored and ours.vmean is None and ours.step == ours.vmean_step == 5
    assert torch.equal(ours.codes, theirs["m_codebook"]) and torch.equal(ours.magnitude, theirs["m_magnitude"])
    # gefen-x sums rows and columns in fp32; the exact sums differ from them by an fp32 rounding at most.
    assert torch.allclose(ours.v_row, theirs["v_row"], rtol=2e-6, atol=0)
    assert torch.allclose(ours.v_col, theirs["v_col"], rtol=2e-6, atol=0)
    assert torch.allclose(w, w_x, rtol=0, atol=1e-6) and not torch.equal(w, _run("block")[0])
    assert torch.equal(b, b_x)  # a vector keeps the block vmean, in both
    assert gx.gefen_read(optim, pb).vmean is not None


def test_a_grouped_weight_is_factored_per_expert():
    """(E, out, in): each expert's matrix has its own rows, columns and mean, as if stepped alone."""
    w3, _, optim3, p3, _ = _run("factored", shape=(3, 16, 24))
    st = gx.gefen_read(optim3, p3)
    assert tuple(st.v_row.shape) == (3, 16) and tuple(st.v_col.shape) == (3, 24)
    torch.manual_seed(0)
    assert bool(torch.isfinite(w3).all()) and not torch.equal(w3[0], w3[1])


# ------------------------------------------------------------------ records and options
def test_a_factored_record_round_trips_and_a_block_one_is_v3s():
    block = ParamRecord("a", (4, 8), 8, 3, 3, dict(GROUP))
    factored = ParamRecord("w", (4, 8), 8, 3, 2, dict(GROUP), factored=True)
    raw = OptimizerRecord(False, 3, [block, factored]).to_json()
    params = json.loads(raw)["params"]
    assert "second_moment" not in params[0] and params[1]["second_moment"] == "factored"
    back = OptimizerRecord.from_json(raw, "a")
    assert [p.factored for p in back.params] == [False, True] and back.params[1].vmean_step == 2
    bad = json.loads(raw)
    bad["params"][1]["second_moment"] = "diagonal"
    with pytest.raises(schema.FormatError, match="second_moment 'diagonal'"):
        OptimizerRecord.from_json(json.dumps(bad), "a")
    bad["params"][1].update(second_moment="factored", shape=[32])
    with pytest.raises(schema.FormatError, match="factored second moment on a 1-D"):
        OptimizerRecord.from_json(json.dumps(bad), "a")


def test_factored_entries_exist_in_v4_only():
    specs = gefen_keys.param_tensor_specs("w", (6, 8), 4, schema.VERSION, factored=True)
    assert specs == {"gefen/qcodes/w": (torch.uint8, (6, 8)), "gefen/grid/w": (torch.float32, (6, 2, 1)),
                     "gefen/vrow/w": (torch.float32, (6,)), "gefen/vcol/w": (torch.float32, (8,))}
    assert gefen_keys.param_tensor_specs("w", (6, 8), 4, schema.V3) == gefen_keys.param_tensor_specs("w", (6, 8), 4)
    with pytest.raises(schema.FormatError, match="v3 record"):
        gefen_keys.param_tensor_specs("w", (6, 8), 4, schema.V3, factored=True)


def test_factored_needs_agreed_blocking_and_a_known_mode():
    with pytest.raises(ValueError, match="second_moment = \"factored\" needs agreed blocking"):
        GefenOptimizersContainer.Config(name="Gefen", blocking=BlockingOptions(mode="per_rank"),
                                        gefen=GefenOptions(second_moment="factored"))
    with pytest.raises(ValueError, match="must be 'auto', 'block' or 'factored'"):
        GefenOptions(second_moment="diagonal")


@pytest.mark.parametrize("mode, second_moment, factored", [
    ("agreed", "auto", True), ("per_rank", "auto", False), ("agreed", "block", False), ("agreed", "factored", True)])
def test_auto_is_factored_under_agreed_blocking_and_block_under_per_rank(mode, second_moment, factored):
    """The default, ``"auto"``, follows the blocking where each optimizer is built (``kwargs(config)``): a
    per-rank run (format v1: ``vmean`` only) keeps block without being told; the table keeps "auto"."""
    from gefen_titan.optim.kinds.gefen import factored as factored_step

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    options = GefenOptions(second_moment=second_moment)
    config = GefenOptimizersContainer.Config(name="Gefen", blocking=BlockingOptions(mode=mode), gefen=options)
    assert config.gefen.second_moment == second_moment  # not written back
    assert options.kwargs(config)["second_moment"] == ("factored" if factored else "block")
    (optim,) = config.build(model_parts=[model]).optimizers
    assert factored_step.is_factored(optim, model[0].weight) == factored
    assert not factored_step.is_factored(optim, model[0].bias)
