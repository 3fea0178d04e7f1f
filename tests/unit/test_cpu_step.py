"""Contract test: the CPU kernel (gefen_titan.optim.cpu_step) steps exactly as gefen-x 0.5.0.

Each case steps two optimizers side by side on the same parameter, gradients
and codebook: gefen-x's own (the reference) and one routed through the
kernel, and compares every bit of what gefen-x's step leaves (the parameter,
codes, magnitudes, ``vmean``, the counters; GefenMuon: the dense momentum
too). The cases are drawn at random (fixed seeds): shapes, periods (1, odd,
below and above the vector widths, 1-D parameters), the four dtypes, lerp
weights on both of torch's branches, weight decay 0 and > 0, ``deterministic``,
tensor and float learning rates, codebooks with duplicate and crowded
codewords (buckets with several thresholds), 1 and 2 threads; plus values
within a few ulps of every threshold, NaN and inf gradients, the first step
from a zero state, and the lone-row reduction the kernel hands back.

Every contract test runs on both builds of the kernel (``lib``): the host's
own (the AVX2 build on x86 CPUs with AVX2) and the portable one (plain C++, as
ARM hosts run it), forced here. Each follows the roundings that the probe
finds in this process's torch. The contract tests also run in child processes
under each of torch's other CPU kernels this host can run
(``ATEN_CPU_CAPABILITY``): its DEFAULT kernels do not fuse ``lerp``, and the
kernel must follow that too. A recording of gefen-x's step made on an AVX-512
host (``tests/fixtures/cpu_step_avx512.pt``) is replayed through the kernel.

The kernel must build and load here (CI has g++): a test that skipped where
it cannot run would prove nothing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gefen_titan.optim import cpu_step
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.optim.cpu_step import build, codebook, probe
from gefen_titan.optim.cpu_step.steps import GefenStep, MuonMomentum, splits_across_threads
from gefen_titan.optim.kinds.gefen.options import GefenOptions
from gefen_titan.optim.kinds.gefen_muon.options import MuonOptions
from gefen_titan.optim.quant.requant import nearest_codes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
ROOT = Path(__file__).resolve().parents[2]
RECORDING = ROOT / "tests" / "fixtures" / "cpu_step_avx512.pt"
# Set in the child processes that rerun the contract under another of torch's CPU kernels: the host's build only.
_CHILD = "GEFEN_TITAN_TEST_CPU_STEP_CHILD"


@pytest.fixture(scope="module", params=["host", "portable"])
def lib(request):
    """The host's build as every process gets it (``cpu_step.kernel()``), and the portable build, each set to
    follow this process's torch and passed the self-check."""
    if request.param == "host":
        got = cpu_step.kernel()
    else:
        if os.environ.get(_CHILD):
            pytest.skip("the child processes rerun the host's build only")
        if build.isa() == "portable":
            pytest.skip("the host's build is the portable one: its run is the 'host' case")
        got = cpu_step.checked(build.load("portable"))
    assert isinstance(got, build.Library), f"the kernel must run on CI machines: {got}"
    assert got.isa == (build.isa() if request.param == "host" else "portable")
    return got


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_codebook(rng: random.Random, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    if kind == "random":
        cb = torch.rand(256, generator=gen) * 2 - 1
    elif kind == "duplicates":  # runs of equal codewords: codes that are never chosen
        base = torch.rand(96, generator=gen) * 2 - 1
        cb = base[torch.randint(0, 96, (256,), generator=gen)]
    else:  # "crowded": most codewords near 0, some 1e-9 apart, some 1 to 3 ulps apart, a few far out
        cb = torch.cat([torch.randn(200, generator=gen) * 1e-6, torch.rand(56, generator=gen) * 2 - 1])
        cb[:40] = cb[0] + torch.arange(40) * 1e-9
        x = torch.tensor(0.3)
        for i in range(60, 70):  # thresholds closer than 256 ulps: the fine table's flagged rows
            x = torch.nextafter(x, torch.tensor(1.0)) if i % 3 else torch.nextafter(torch.nextafter(x, torch.tensor(
                1.0)), torch.tensor(1.0))
            cb[i] = x
    cb = torch.sort(cb).values
    cb[0], cb[-1] = -1.0, 1.0
    return cb


def gefen(p: torch.Tensor, deterministic: bool = False, **group) -> torch.optim.Optimizer:
    return gx.new_gefen([{"params": [("w", p)], **group}], fused=False, factored_v_2d=False,
                        deterministic=deterministic)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def run_gefen(lib, routed: bool, *, init, grads, cb, period, group, deterministic=False, zero_start=False):
    p = torch.nn.Parameter(init.clone())
    optim = gefen(p, deterministic, **group)
    gx.set_codebook(optim, cb.clone())
    gx.set_period(optim, p, period)
    if zero_start:  # the state gefen-x allocates before its first step, so the kernel takes step 1
        blocks = p.numel() // period
        gx.gefen_write(optim, p, gx.GefenParamState(period, 0, 0, torch.zeros(blocks, period, dtype=torch.uint8),
                                         torch.zeros(blocks, 1), torch.zeros(blocks, 1)))
    step = GefenStep(optim, lib)
    if routed:
        gx.route_cpu_step(optim, step)
    for g in grads:
        p.grad = g.clone()
        optim.step()
    st = gx.gefen_read(optim, p)
    return {"param": p.detach(), "codes": st.codes, "magnitude": st.magnitude, "vmean": st.vmean,
            "counters": torch.tensor([st.step, st.vmean_step, gx.global_step(optim)])}, step


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every element's bits equal, or both NaN: torch does not keep a NaN's sign and payload (its bf16
    ``add_(x, alpha)`` writes 0xFFFF in its vector loop and 0x7FC0 in its scalar tail, whose place
    depends on the thread count), so neither does the contract."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = a.element_size()
    equal = (bits(a).view(-1, width) == bits(b).view(-1, width)).all(dim=1)
    if a.is_floating_point():
        equal |= a.reshape(-1).isnan() & b.reshape(-1).isnan()
    return bool(equal.all())


def assert_same(ref: dict, got: dict, what: str) -> None:
    differ = [k for k in ref if not same_bits(ref[k], got[k])]
    assert not differ, f"{what}: {differ} differ from gefen-x's"


def draw_case(rng: random.Random) -> dict:
    dtype = rng.choice(DTYPES)
    period = rng.choice([1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 33, 64, 100, 257, 1000])
    rows = rng.randint(1, max(1, 3000 // period))
    shape = (rows * period,) if rng.random() < 0.2 else (rows, period)
    beta1 = rng.choice([0.9, 0.95, 0.6, 0.3, 0.0])  # w = 1 - beta1 on both sides of torch's 0.5
    group = {"lr": rng.choice([1e-3, 3e-2, 0.1]), "betas": (beta1, rng.choice([0.999, 0.95, 0.5])),
             "eps": rng.choice([1e-8, 1e-3]), "weight_decay": rng.choice([0.0, 0.1, 0.01])}
    if rng.random() < 0.2:
        group["lr"] = torch.tensor(group["lr"])
    return {"dtype": dtype, "period": period, "shape": shape, "group": group,
            "cb": rng.choice(["random", "duplicates", "crowded"]), "deterministic": rng.random() < 0.3,
            "scale": rng.choice([1e-4, 1e-2, 1.0])}


def tensors(case: dict, rng: random.Random, steps: int = 3):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    init = torch.randn(*case["shape"], generator=gen).to(case["dtype"])
    grads = []
    for _ in range(steps):
        g = torch.randn(*case["shape"], generator=gen) ** 3 * case["scale"]
        flat = g.view(-1)
        if rng.random() < 0.3:  # exact zeros and whole zero rows: magnitude 0
            flat[: case["period"] * rng.randint(0, 2)] = 0.0
        grads.append(g.to(case["dtype"]))
    return init, grads


@pytest.mark.parametrize("seed", range(6))
def test_random_cases_are_bit_identical_to_gefen_x(lib, seed):
    rng = random.Random(seed)
    for i in range(8):
        case = draw_case(rng)
        torch.set_num_threads(1 if (seed + i) % 3 else 2)
        init, grads = tensors(case, rng)
        cb = make_codebook(rng, case["cb"])
        kw = dict(init=init, grads=grads, cb=cb, period=case["period"], group=case["group"],
                  deterministic=case["deterministic"], zero_start=i % 4 == 0)
        ref, _ = run_gefen(lib, False, **kw)
        got, step = run_gefen(lib, True, **kw)
        what = f"seed {seed} case {i}: {case}"
        assert step.taken == len(grads) - (0 if kw["zero_start"] else 1), (what, dict(step.declined))
        assert_same(ref, got, what)


def test_a_parameter_split_across_threads_is_bit_identical(lib):
    """Rows spread over several tasks of ``at::parallel_for``: the same bits at 1 and 2 threads."""
    rng = random.Random(7)
    case = {"dtype": torch.float32, "period": 128, "shape": (600, 128), "scale": 1e-2}
    init, grads = tensors(case, rng)
    kw = dict(init=init, grads=grads, cb=make_codebook(rng, "random"), period=128,
              group={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        ref, _ = run_gefen(lib, False, **kw)
        got, step = run_gefen(lib, True, **kw)
        assert step.taken == 2
        assert_same(ref, got, f"{threads} threads")
        outs.append(got)
    assert_same(outs[0], outs[1], "1 vs 2 threads")


@pytest.mark.parametrize("kind", ["random", "duplicates", "crowded"])
def test_values_within_ulps_of_every_threshold(lib, kind):
    """beta1 = 0 makes the momentum the gradient itself, and a 1.0 in every row makes its
    magnitude 1, so the values requantized are exactly the ones written: each of the
    codebook's thresholds and its neighbours up to 3 ulps either side, both signs of zero."""
    cb = make_codebook(random.Random(hash(kind) % 1000), kind)
    table = codebook.table_for(cb, torch.float32)
    keys = table.thresholds.numpy().view(np.uint32).astype(np.int64)
    keys = keys[(keys > codebook.KEY_MIN) & (keys <= codebook.KEY_MAX)]
    near = np.unique(np.clip(np.concatenate([keys + d for d in range(-3, 4)]), codebook.KEY_MIN, codebook.KEY_MAX))
    x = torch.from_numpy(codebook.floats_of_keys(near).copy())
    x = torch.cat([x[x.abs() <= 1], torch.tensor([0.0, -0.0, 1.0, -1.0])])
    period = 64
    rows = -(-x.numel() // (period - 1))
    body = torch.zeros(rows * (period - 1))
    body[: x.numel()] = x
    grid = torch.cat([torch.ones(rows, 1), body.view(rows, period - 1)], dim=1)
    group = {"lr": 1e-2, "betas": (0.0, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    kw = dict(init=torch.randn(rows, period), grads=[grid.clone(), grid.clone()], cb=cb, period=period, group=group)
    ref, _ = run_gefen(lib, False, **kw)
    got, step = run_gefen(lib, True, **kw)
    assert step.taken == 1
    assert_same(ref, got, kind)
    assert torch.equal(got["codes"].view(-1), nearest_codes(cb, grid).view(-1))
    if kind == "crowded":  # the buckets one compare cannot answer, and the fine rows' flagged keys
        assert int(((table.table.numpy().view(np.uint32) & 0xFFFF) == 0xFF).sum()) > 2
        assert int((table.fine.numpy().view(np.uint32) == 0xFF).sum()) > 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_gradients(lib, dtype):
    rng = random.Random(3)
    case = {"dtype": dtype, "period": 24, "shape": (40, 24), "scale": 1e-2}
    init, grads = tensors(case, rng, steps=4)
    for step, g in enumerate(grads[1:], 1):
        flat = g.view(-1)
        flat[24 * step + 3] = float("nan")
        flat[24 * (step + 5) + 7] = float("inf")
        flat[24 * (step + 9)] = -float("inf")
        flat[24 * (step + 12) + 1] = float("inf")
        flat[24 * (step + 12) + 2] = float("nan")
    kw = dict(init=init, grads=grads, cb=make_codebook(rng, "random"), period=24,
              group={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
    ref, _ = run_gefen(lib, False, **kw)
    got, step = run_gefen(lib, True, **kw)
    assert step.taken == 3 and bool(ref["param"].isnan().any()) and bool(ref["magnitude"].isnan().any())
    assert_same(ref, got, str(dtype))


def test_lone_row_summed_across_threads_goes_to_gefen_x(lib):
    """torch sums a lone 32768+-element row in per-thread pieces (an order that depends on the thread
    count): the kernel hands that parameter to gefen-x, which gives gefen-x's bits."""
    assert splits_across_threads(1, 40000, 2) and not splits_across_threads(1, 40000, 1)
    assert not splits_across_threads(4, 40000, 2) and splits_across_threads(257, 32768, 2)
    torch.set_num_threads(2)
    rng = random.Random(5)
    case = {"dtype": torch.float32, "period": 40000, "shape": (40000,), "scale": 1e-2}
    init, grads = tensors(case, rng)
    kw = dict(init=init, grads=grads, cb=make_codebook(rng, "random"), period=40000,
              group={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0})
    ref, _ = run_gefen(lib, False, **kw)
    got, step = run_gefen(lib, True, **kw)
    assert step.taken == 0 and step.declined["a lone row that torch sums across threads"] == 2
    assert_same(ref, got, "lone row")


# ------------------------------------------------------------------ GefenMuon
def run_muon(lib, routed: bool, *, init, grads, cb, period, group):
    p = torch.nn.Parameter(init.clone())
    optim = gx.new_gefen_muon([{"params": [("w", p)], **group}], fused=False)
    gx.set_codebook(optim, cb.clone())
    gx.set_period(optim, p, period)
    step = MuonMomentum(optim, lib)
    if routed:
        gx.route_cpu_step(optim, step)
    (group_,) = optim.param_groups
    dense = [gx.muon_momentum(optim, "w", p, group_, g.clone()) for g in grads]
    st = gx.muon_read(optim, p)
    return {"dense": torch.stack(dense), "codes": st.codes, "magnitude": st.magnitude,
            "step": torch.tensor(st.step)}, step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum, nesterov", [(0.95, True), (0.9, False), (0.3, True)])
def test_muon_momentum_is_bit_identical(lib, dtype, momentum, nesterov):
    """bf16/fp16 with Nesterov goes to gefen-x: torch rounds that blend's ``add_(g, alpha)`` in two
    ways by position (in float in its vector loop, in the dtype in its scalar tail)."""
    rng = random.Random(int(momentum * 100) + nesterov)
    case = {"dtype": dtype, "period": 48, "shape": (33, 96), "scale": 1e-2}
    init, grads = tensors(case, rng, steps=4)
    grads[2].view(-1)[5] = float("nan")  # a NaN magnitude: not masked by GefenMuon (<= 0)
    kw = dict(init=init, grads=grads, cb=make_codebook(rng, "duplicates"), period=48,
              group={"lr": 1e-2, "momentum": momentum, "nesterov": nesterov})
    ref, _ = run_muon(lib, False, **kw)
    got, step = run_muon(lib, True, **kw)
    reduced_nesterov = nesterov and dtype in (torch.bfloat16, torch.float16)
    assert step.taken == (0 if reduced_nesterov else 3), dict(step.declined)
    assert_same(ref, got, f"{dtype} momentum {momentum} nesterov {nesterov}")


def test_muon_momentum_of_grouped_experts_is_bit_identical(lib):
    """A mixture-of-experts grouped weight ``(E, out, in)`` (GefenMuon takes each expert's matrix): its
    momentum is per block of the flat local tensor, so the kernel takes it whole, shaped like the gradient."""
    rng = random.Random(7)
    case = {"dtype": torch.float32, "period": 48, "shape": (4, 12, 96), "scale": 1e-2}
    init, grads = tensors(case, rng, steps=4)
    kw = dict(init=init, grads=grads, cb=make_codebook(rng, "random"), period=48,
              group={"lr": 1e-2, "momentum": 0.95, "nesterov": True})
    ref, _ = run_muon(lib, False, **kw)
    got, step = run_muon(lib, True, **kw)
    assert step.taken == 3, dict(step.declined)
    assert got["dense"].shape == (4, 4, 12, 96)
    assert_same(ref, got, "grouped experts' momentum")


# ------------------------------------------------------------------ the kernel's own checks
def test_the_vectorized_sums_follow_the_plain_rendering_of_torchs_algorithm(lib):
    """At every width the step sums in (vectorized where the build has vector loops), the sum equals the
    plain rendering of torch's algorithm, which the probe compares with torch's own sums."""
    f = lib.lib.gt_row_sumsq
    out = ctypes.c_double()
    for code, dtype in enumerate(DTYPES):
        for n in (1, 7, 8, 15, 16, 17, 63, 64, 65, 257, 1000, 4096, 4099, 70001):
            g = torch.randn(n).to(dtype)
            for width in probe.CANDIDATE_WIDTHS:
                got = []
                for vectorized in (1, 0):
                    assert f(g.data_ptr(), n, code, width, vectorized, ctypes.byref(out)) == 0
                    got.append(out.value)
                assert got[0] == got[1], (dtype, n, width, got)
    assert f(g.data_ptr(), 8, 0, 3, 0, ctypes.byref(out)) == -1  # a width it does not render


def test_the_probe_rows_tell_every_candidate_order_apart(lib):
    """Otherwise the probe could pick an order torch does not use: for each dtype, every two candidate
    widths render the probe rows differently somewhere."""
    for dtype in (torch.float32, torch.float64):
        rendered = {w: [probe.renderings(lib, g, w) for g in probe.probe_rows(dtype)]
                    for w in probe.CANDIDATE_WIDTHS}
        for a in probe.CANDIDATE_WIDTHS:
            for b in probe.CANDIDATE_WIDTHS:
                if a < b:
                    assert any(not torch.equal(x, y) for x, y in zip(rendered[a], rendered[b])), (dtype, a, b)


def test_the_probe_finds_torchs_order_from_what_torch_sums(lib, monkeypatch):
    """The width comes from torch's sums, not from a capability name: a torch that summed in 16-lane order
    (faked) gets 16, and one that follows no candidate gets a reason and no kernel."""
    real = probe.probe(lib)
    assert isinstance(real, probe.TorchRoundings)
    assert (real.sum_width, real.sum_width_f64, real.fused) == (lib.sum_width, lib.sum_width_f64, lib.fused)

    def faked(width):
        return lambda dtype: [probe.Observation(g, probe.renderings(lib, g, width)) for g in probe.probe_rows(dtype)]

    monkeypatch.setattr(probe, "observe", faked(16))
    assert probe.probe(lib).sum_width == 16
    monkeypatch.setattr(probe, "observe", lambda dtype: [probe.Observation(g, (g * g).sum(dim=1) * 1.5)
                                                         for g in probe.probe_rows(dtype)])
    reason = probe.probe(lib)
    assert isinstance(reason, str) and "follow none of the orders" in reason
    got = cpu_step.checked(lib)
    assert isinstance(got, build.Unavailable) and "cannot follow this torch's roundings" in got.reason


def test_the_probe_tells_a_fused_lerp_from_two_roundings(monkeypatch):
    """torch's AVX2 and AVX-512 kernels fuse lerp and add_(alpha); a torch whose lerp rounds twice (as its
    DEFAULT kernels, faked here) is found so, and one that does neither is refused."""
    assert probe.fused_of() is (torch.backends.cpu.get_cpu_capability() != "DEFAULT")
    real_lerp, real_add = torch.lerp, torch.Tensor.add_

    def two_roundings(a, b, w):
        wf = probe.np.float32(w)
        return a + float(wf) * (b - a) if w < 0.5 else b - float(probe.np.float32(1.0) - wf) * (b - a)

    def add_two(self, other, alpha=1):
        return real_add(self, (other.double() * float(probe.np.float32(alpha))).float())

    monkeypatch.setattr(torch, "lerp", two_roundings)
    monkeypatch.setattr(torch.Tensor, "add_", add_two)
    assert probe.fused_of() is False
    monkeypatch.setattr(torch, "lerp", lambda a, b, w: real_lerp(a, b, w) + 1e-3)
    assert "neither once nor twice" in probe.fused_of()


def test_the_self_check_catches_a_kernel_that_rounds_otherwise(lib):
    assert cpu_step._self_check(lib) is None
    assert "vmean" in cpu_step._self_check(dataclasses.replace(lib, sum_width=16 if lib.sum_width != 16 else 8))
    assert "parameter" in cpu_step._self_check(dataclasses.replace(lib, fused=not lib.fused))


# ------------------------------------------------------------------ other hosts
def _recording() -> dict:
    from torch.torch_version import TorchVersion

    with torch.serialization.safe_globals([TorchVersion]):
        return torch.load(RECORDING, weights_only=True)


def test_the_avx512_recording_replays_bit_identically(lib):
    """gefen-x's steps recorded on an AVX-512 Xeon. The probe finds that host's sum order from its recorded
    reductions: 8 lanes, not its vector width. In that order the kernel reproduces every recorded ``vmean``,
    code, magnitude and counter, and every recorded parameter wherever gefen-x's own step here reproduces it
    too. The parameter goes through ``torch.sqrt(vmean)``, which torch computes around the kernel, and which
    on x86 is MKL's ``vsSqrt``: MKL picks its code path by CPU, and on an AMD EPYC gefen-x's own step left
    15 of the 48 recorded parameters different (only those). There the kernel, at this process's roundings,
    equals gefen-x's step here.
    The fp64 order and fused lerp are this torch's (the recording holds fp32 sums; torch's AVX-512 kernels
    fuse). In the 16-lane order, which the kernel used to pick for AVX-512 hosts, recorded vmeans differ."""
    rec = _recording()
    assert rec["capability"] == "AVX512" and len(rec["gefen_steps"]) == 48 and len(rec["block_means"]) == 57
    if not lib.fused:
        # Each case's first step is gefen-x's own (torch ops), and torch's DEFAULT kernels round its lerp twice
        # where the recording host's fused it: every later state differs before the kernel takes a step.
        pytest.skip("torch's lerp is not fused here (its DEFAULT kernels); the recording host's was")
    observed = [probe.Observation(b["g"].float().reshape(b["g"].shape[0], -1), b["sum_sq"].reshape(-1))
                for b in rec["block_means"]]
    width = probe.width_of(lib, observed)
    assert width == 8, width
    for b in rec["block_means"]:  # and torch's mean there is that sum / period, as the kernel takes it
        assert torch.equal(b["mean_sq"], b["sum_sq"] / b["period"])
    replay = dataclasses.replace(lib, sum_width=width, fused=True)
    host_params = 0
    for case in rec["gefen_steps"]:
        torch.set_num_threads(case["threads"])
        what = f"recorded case seed {case['seed']} #{case['i']} {case['case']}"
        got, step = run_gefen(replay, True, **case["inputs"])
        assert step.taken >= len(case["inputs"]["grads"]) - 1, dict(step.declined)
        assert_same({k: v for k, v in case["ref"].items() if k != "param"}, got, what)
        if not same_bits(case["ref"]["param"], got["param"]):
            # gefen-x's own step here gives another parameter too, and the kernel at this process's roundings
            # (not the recording's: torch may run other kernels here, e.g. ATEN_CPU_CAPABILITY=default) equals it.
            own, _ = run_gefen(lib, False, **case["inputs"])
            assert not same_bits(case["ref"]["param"], own["param"]), f"{what}: only the kernel's parameter differs"
            assert_same(own, run_gefen(lib, True, **case["inputs"])[0], f"{what} (against gefen-x's step here)")
            host_params += 1
    print(f"recording replayed: 48 cases; {host_params} parameters differ from the recording in gefen-x's own "
          "step on this host too (torch.sqrt)")
    wide = dataclasses.replace(lib, sum_width=16, fused=True)
    vmeans = [same_bits(c["ref"]["vmean"], run_gefen(wide, True, **c["inputs"])[0]["vmean"])
              for c in rec["gefen_steps"][:16]]
    assert not all(vmeans)


_OTHER_CAPABILITIES = {"AVX512": ["avx2", "default"], "AVX2": ["default"]}


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_contract_holds_under_torchs_other_cpu_kernels(capability):
    """torch's AVX2 and DEFAULT kernels, where this host runs better ones: the same contract tests in a child
    process with ``ATEN_CPU_CAPABILITY`` set (the DEFAULT kernels round lerp twice: the probe finds it)."""
    host = torch.backends.cpu.get_cpu_capability()
    if os.environ.get(_CHILD):
        pytest.skip("already a child")
    if capability not in _OTHER_CAPABILITIES.get(host, []):
        pytest.skip(f"torch runs its {host} kernels here: {capability} is this host's own run or beyond it")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, _CHILD: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           __file__, "-k", "random_cases or muon_momentum or threshold or nan_and_inf",
                           "-W", "ignore::DeprecationWarning"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail


def test_codebook_rule_needs_sorted_finite_codewords():
    cb = torch.linspace(-1, 1, 256)
    with pytest.raises(ValueError, match="sorted"):
        codebook.table_for(cb.flip(0), torch.float32)
    bad = cb.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        codebook.table_for(bad, torch.float32)
    one = codebook.table_for(torch.tensor([0.5]), torch.float32)
    assert one.thresholds.numel() == 0 and one.nan_code == 0


# ------------------------------------------------------------------ where it runs, and the log
def test_without_a_compiler_the_reason_is_given(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    got = build._load(build.isa())
    assert isinstance(got, build.Unavailable) and "no C++ compiler" in got.reason


def test_the_build_is_chosen_by_the_cpus_instructions(monkeypatch):
    """The AVX2 build where the CPU has AVX2, FMA and F16C (AVX-512 CPUs included), else the portable one;
    the environment variable forces one, and an unknown name is a reason, not a crash."""
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(build, "_cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f"})
    assert build.isa() == "avx2"
    monkeypatch.setattr(build, "_cpu_flags", lambda: {"sse4_2", "avx"})
    assert build.isa() == "portable"
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(build, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert build.isa() == "portable"
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    assert build.isa() == "avx2"
    monkeypatch.setenv(build.ISA_ENV, "avx9")
    got = build.load()
    assert isinstance(got, build.Unavailable) and build.ISA_ENV in got.reason and "portable" in got.reason


def test_an_unavailable_kernel_warns_once_and_gefen_x_steps(monkeypatch, caplog):
    monkeypatch.setattr(cpu_step, "_checked", None)
    monkeypatch.setattr(cpu_step, "load", lambda: build.Unavailable("no C++ compiler found (test)"))
    p = torch.nn.Parameter(torch.randn(16, 8))
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            optim = gefen(p, lr=1e-2)
            path = cpu_step.install(optim, "kernel", "Gefen")
            assert cpu_step.routed_step(optim) is None and "gefen-x's own step" in path
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C++ compiler found (test)" in warnings[0].getMessage()
    gx.set_codebook(optim, make_codebook(random.Random(0), "random"))
    gx.set_period(optim, p, 8)
    for _ in range(2):
        p.grad = torch.randn(16, 8)
        optim.step()
    assert gx.gefen_read(optim, p).step == 2


def _container(**kw) -> GefenOptimizersContainer:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    return GefenOptimizersContainer.Config(name="Gefen", lr=1e-2, **kw).build(model_parts=[model])


def test_the_recipe_key_picks_the_path_and_the_log_names_it(lib, caplog):
    with caplog.at_level(logging.INFO):
        default = _container()
        own = _container(gefen=GefenOptions(cpu_step="gefen-x"))
    (opt_default,), (opt_own,) = default.optimizers, own.optimizers
    assert isinstance(cpu_step.routed_step(opt_default), GefenStep)
    assert cpu_step.routed_step(opt_own) is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Gefen (cpu parameters)")]
    assert len(lines) == 2 and "exact CPU kernel" in lines[0] and 'cpu_step = "gefen-x"' in lines[1]
    with pytest.raises(ValueError, match="optimizer.gefen.cpu_step must be"):
        GefenOptions(cpu_step="fast")
    with pytest.raises(ValueError, match="optimizer.muon.cpu_step must be"):
        MuonOptions(cpu_step="fast")


@pytest.mark.parametrize("second_moment", ["block", "factored"])
def test_the_container_steps_through_the_kernel(lib, second_moment):
    torch.manual_seed(0)
    routed = _container(gefen=GefenOptions(second_moment=second_moment))
    own = _container(gefen=GefenOptions(cpu_step="gefen-x", second_moment=second_moment))
    models = []
    for opt in (routed, own):
        (optim,) = opt.optimizers
        params = [p for g in optim.param_groups for p in g["params"]]
        models.append(params)
    with torch.no_grad():
        for a, b in zip(*models):
            b.copy_(a)
    for s in range(3):
        for a, b in zip(*models):
            a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(s)) * 1e-2
            b.grad = a.grad.clone()
        routed.step()
        own.step()
    for a, b in zip(*models):
        assert torch.equal(a, b)
    step = cpu_step.routed_step(routed.optimizers[0])
    # Steps 2 and 3 (step 1 learns the codebook in gefen-x); factored matrices take the factored step
    # (whose momentum update is the kernel's too: test_factored_kernel), every other parameter this one.
    block_stepped = [p for p in models[0] if second_moment == "block" or p.ndim < 2]
    assert step.taken == 2 * len(block_stepped) and 0 < len(block_stepped)
