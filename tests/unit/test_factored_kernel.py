"""Contract test: the factored second moment's momentum update on the CPU kernel is gefen-x's, bit for bit.

``[optimizer.gefen] second_moment = "factored"`` takes each matrix's step
itself (``optim.kinds.gefen.factored``) and calls gefen-x's quantized
momentum update (``gefenx.gefen_momentum_update``: dequantize, lerp, per-block
absmax, requantize, the dense momentum back). On CPU tensors it calls the
kernel's instead (``cpu_step.factored_momentum``: ``GefenMomentum``, the
``gt_gefen_momentum`` entry), which must leave the same codes and magnitudes
and return the same dense momentum, or decline.

The momentum is compared alone, over several steps, on the four dtypes, both
of torch's lerp branches, zero blocks, NaN and inf, subnormal magnitudes,
exact ties between codewords, period 1, odd periods and a lone row long
enough that torch would sum it across threads (the block step declines that
row for its vmean; the momentum sums nothing and takes it); then whole
factored optimizers, kernel against gefen-x, parameters and state. Each on
the host's build and the portable one (``lib``), and in child processes under
torch's other CPU kernels (``ATEN_CPU_CAPABILITY``), as
``tests/unit/test_cpu_step.py`` does for the block step.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from gefen_titan.optim import cpu_step
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.optim.cpu_step import build
from gefen_titan.optim.cpu_step.steps import GRAIN_SIZE, GefenMomentum, GefenStep, splits_across_threads
from gefen_titan.optim.kinds.gefen.options import GefenOptions

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
ROOT = Path(__file__).resolve().parents[2]
_CHILD = "GEFEN_TITAN_TEST_FACTORED_KERNEL_CHILD"


@pytest.fixture(scope="module", params=["host", "portable"])
def lib(request):
    """The host's build as every process gets it, and the portable build, each checked against torch."""
    if request.param == "host":
        got = cpu_step.kernel()
    else:
        if os.environ.get(_CHILD):
            pytest.skip("the child processes rerun the host's build only")
        if build.isa() == "portable":
            pytest.skip("the host's build is the portable one: its run is the 'host' case")
        got = cpu_step.checked(build.load("portable"))
    assert isinstance(got, build.Library), f"the kernel must run on CI machines: {got}"
    return got


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def codebook(kind: str, seed: int = 0) -> torch.Tensor:
    """``dyadic``: j/128 (every midpoint exact, so values can tie); ``random``: 256 sorted uniform codewords."""
    if kind == "dyadic":
        cb = torch.arange(-128, 128, dtype=torch.float32) / 128
    else:
        cb = torch.sort(torch.rand(256, generator=torch.Generator().manual_seed(seed)) * 2 - 1).values
    cb[0], cb[-1] = -1.0, 1.0
    return cb


def momentum_state(shape: tuple[int, ...], period: int, dtype: torch.dtype, cb: torch.Tensor):
    """A Gefen holding one factored parameter's zero state, as the factored step's first call leaves it."""
    p = nn.Parameter(torch.zeros(shape, dtype=dtype))
    optim = gx.new_gefen([{"params": [("w", p)], "lr": 1e-2}], fused=False, factored_v_2d=False)
    gx.set_codebook(optim, cb.clone())
    gx.set_period(optim, p, period)
    gx.gefen_factored_init(optim, p, p.detach().reshape(-1, period), tuple(shape[:-1]), tuple(shape[-1:]))
    return optim, p


def compare_momentum(lib, shape, period, dtype, grads, beta1s, cb) -> GefenMomentum:
    """Step gefen-x's momentum update and the kernel's side by side; every step's dense momentum, codes and
    magnitudes must be the same bits. Returns the kernel's step (its counters)."""
    ref_optim, ref_p = momentum_state(shape, period, dtype, cb)
    optim, p = momentum_state(shape, period, dtype, cb)
    kernel = GefenMomentum(optim, lib)
    for i, (g, beta1) in enumerate(zip(grads, beta1s)):
        view = g.to(dtype).reshape(-1, period)
        want = gx.gefen_momentum_update(ref_optim, ref_p, view, beta1)
        got = kernel(p, view, beta1)
        assert got is not None, dict(kernel.declined)
        ref, st = gx.gefen_read(ref_optim, ref_p), gx.gefen_read(optim, p)
        what = f"{dtype} {shape} period {period} step {i} beta1 {beta1}"
        assert got.dtype == want.dtype and got.shape == want.shape, what
        for name, a, b in (("dense momentum", want, got), ("codes", ref.codes, st.codes),
                           ("magnitudes", ref.magnitude, st.magnitude)):
            assert torch.equal(bits(a), bits(b)), f"{what}: the {name} differ from gefen-x's"
    assert kernel.taken == len(grads) and not kernel.declined
    return kernel


def special_grads(shape: tuple[int, ...], period: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Random gradients with a block of zeros in every step (its magnitude 0), a block of subnormals (its
    magnitude subnormal), and from the second step a NaN, in the third an inf."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        g = torch.randn(shape, generator=gen) ** 3 * 1e-2
        flat = g.view(-1)
        blocks = flat.numel() // period
        flat[:period] = 0.0  # block 0: zeros throughout (magnitude 0)
        if blocks > 3:
            flat[period:2 * period] = torch.randn(period, generator=gen) * 1e-39  # subnormal block
        if blocks > 5 and s >= 1:
            flat[3 * period + period // 2] = float("nan")
        if blocks > 6 and s == 2:
            flat[5 * period] = float("-inf")
        out.append(g)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("period", [1, 7, 12, 33, 256])
def test_the_momentum_update_is_gefen_xs(lib, dtype, period):
    shape = (max(8, 2000 // period), period) if period > 1 else (40, 24)
    grads = special_grads(shape, period, 4, seed=period)
    beta1s = [0.9, 0.2, 0.9, 0.0]  # lerp weight 0.1 and 0.8, 1.0: both of torch's branches
    compare_momentum(lib, shape, period, dtype, grads, beta1s, codebook("random", period))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_between_codewords(lib, dtype):
    """beta1 = 0: the updated momentum is the gradient itself, so gradients made of the dyadic codebook's
    midpoints (and its codewords) with a block maximum of 1 are exact ties: the lower codeword wins."""
    gen = torch.Generator().manual_seed(3)
    shape, period = (64, 40), 40
    grads = []
    for _ in range(3):
        odd = torch.randint(-128, 128, shape, generator=gen) * 2 + 1
        g = torch.where(torch.rand(shape, generator=gen) < 0.7, odd / 256, odd.div(2, rounding_mode="floor") / 128)
        g[:, 0] = 1.0
        grads.append(-g if len(grads) == 1 else g)
    cb = codebook("dyadic")
    x = grads[0].view(-1, period) / grads[0].view(-1, period).abs().amax(dim=1, keepdim=True)
    assert bool(((x * 256) % 2 == 1).any())  # midpoints reach the requantization
    compare_momentum(lib, shape, period, dtype, grads, [0.0, 0.0, 0.0], cb)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_lone_long_row_is_taken_at_any_thread_count(lib, threads):
    """One block of GRAIN_SIZE+ elements, which torch would sum across threads: the block step declines it
    (its vmean), the momentum update (a max, the same at any split) takes it."""
    torch.set_num_threads(threads)
    period = GRAIN_SIZE + 1000
    assert splits_across_threads(1, period, 2)
    grads = special_grads((1, period), period, 3, seed=11)
    grads[1][0, 7] = float("nan")  # the row's first NaN, a later one too
    grads[1][0, 20000] = float("nan")
    compare_momentum(lib, (1, period), period, torch.float32, grads, [0.9, 0.9, 0.9], codebook("random"))
    # and several rows split over the kernel's tasks and torch's threads alike
    shape = (700, 96)
    compare_momentum(lib, shape, 96, torch.float32, special_grads(shape, 96, 3, seed=13), [0.9] * 3,
                     codebook("random", 5))


def test_the_momentum_declines_what_the_kernel_cannot_take(lib):
    optim, p = momentum_state((6, 8), 8, torch.float32, codebook("random"))
    kernel = GefenMomentum(optim, lib)
    g = torch.randn(6, 12)[:, :8].reshape(-1, 8)  # not contiguous: taken (read through a contiguous copy)
    assert not g.is_contiguous() and kernel(p, g, 0.9) is not None
    other = nn.Parameter(torch.zeros(6, 8))  # no state
    assert kernel(other, torch.randn(6, 8), 0.9) is None
    gx.set_codebook(optim, None)
    assert kernel(p, torch.randn(6, 8), 0.9) is None
    assert dict(kernel.declined) == {"no state yet (its first step, or an empty shard)": 1, "no codebook": 1}


# ------------------------------------------------------------------ whole factored optimizers
def factored_run(mode: str, dtype: torch.dtype, steps: int = 4):
    """Steps of a matrix, a grouped experts' weight and a vector under second_moment = "factored", on the
    kernel (``mode="kernel"``) or gefen-x's own path, from the same codebook, periods and gradients."""
    torch.manual_seed(0)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(48, 40, dtype=dtype))
    model.e = nn.Parameter(torch.randn(3, 16, 24, dtype=dtype))
    model.b = nn.Parameter(torch.randn(40, dtype=dtype))
    opt = GefenOptimizersContainer.Config(name="Gefen", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                                          gefen=GefenOptions(second_moment="factored", cpu_step=mode)
                                          ).build(model_parts=[model])
    opt.agreement = None  # the codebook and periods below, as the agreement would set them
    (optim,) = opt.optimizers_of("Gefen")
    gx.set_codebook(optim, codebook("random", 1))
    gx.set_period(optim, model.w, 40)
    gx.set_period(optim, model.e, 24)
    gx.set_period(optim, model.b, 1)
    gen = torch.Generator().manual_seed(1)
    for s in range(steps):
        for p in (model.w, model.e, model.b):
            g = torch.randn(p.shape, generator=gen) * 1e-2
            if s == 1 and p is model.w:
                g[2] = 0.0  # a zero row
            p.grad = g.to(dtype)
        optim.step()
    return model, optim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_factored_optimizer_on_the_kernel_is_gefen_xs(dtype):
    steps = 4
    model, optim = factored_run("kernel", dtype, steps)
    ref_model, ref_optim = factored_run("gefen-x", dtype, steps)
    assert cpu_step.factored_momentum(ref_optim) is None
    routed = cpu_step.routed_step(optim)
    assert isinstance(routed, GefenStep)
    assert routed.momentum.taken == 2 * steps and not routed.momentum.declined  # w and e, every step
    for name in ("w", "e", "b"):
        p, q = getattr(model, name), getattr(ref_model, name)
        assert torch.equal(bits(p), bits(q)), f"parameter {name}"
        a, b = gx.gefen_read(optim, p), gx.gefen_read(ref_optim, q)
        assert (a.step, a.vmean_step) == (b.step, b.vmean_step) == (steps, steps)
        for what in ("codes", "magnitude", "vmean", "v_row", "v_col"):
            x, y = getattr(a, what), getattr(b, what)
            assert (x is None) == (y is None) and (x is None or torch.equal(bits(x), bits(y))), f"{name} {what}"
    assert gx.gefen_read(optim, model.w).factored and not gx.gefen_read(optim, model.b).factored


# ------------------------------------------------------------------ torch's other CPU kernels
_OTHER_CAPABILITIES = {"AVX512": ["avx2", "default"], "AVX2": ["default"]}


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_contract_holds_under_torchs_other_cpu_kernels(capability):
    """torch's AVX2 and DEFAULT kernels (DEFAULT rounds lerp twice), where this host runs better ones: the
    momentum and whole-optimizer tests in a child process with ``ATEN_CPU_CAPABILITY`` set."""
    host = torch.backends.cpu.get_cpu_capability()
    if os.environ.get(_CHILD):
        pytest.skip("already a child")
    if capability not in _OTHER_CAPABILITIES.get(host, []):
        pytest.skip(f"torch runs its {host} kernels here: {capability} is this host's own run or beyond it")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, _CHILD: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           __file__, "-k", "gefen_xs or ties or random_shapes", "-W", "ignore::DeprecationWarning"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail


def test_random_shapes(lib):
    """A few drawn cases: shapes, periods, dtypes, lerp weights, codebooks."""
    rng = random.Random(0)
    for i in range(6):
        dtype = rng.choice(DTYPES)
        period = rng.choice([1, 3, 8, 9, 16, 17, 31, 64, 100])
        shape = (rng.randint(1, max(1, 1500 // period)), period)
        gen = torch.Generator().manual_seed(i)
        grads = [torch.randn(shape, generator=gen) ** 3 * rng.choice([1e-4, 1.0]) for _ in range(3)]
        beta1s = [rng.choice([0.95, 0.9, 0.6, 0.3, 0.0]) for _ in grads]
        compare_momentum(lib, shape, period, dtype, grads, beta1s, codebook("random", i))
