"""The Triton kernels of ``gefen_titan.optim.quant.kernels`` give the reference's bits.

Every check in ``CASES`` runs the same inputs through the kernels
(``use_backend("triton")``) and the pure-torch reference
(``use_backend("reference")``) and asserts bit-identical results: codes,
magnitudes, dequantized values, block means, the adapter's rebuilt slot state,
and the same ``ValueError`` on non-finite input.

Where they run:

* Triton's interpreter on CPU tensors, always. ``TRITON_INTERPRET=1`` has to be
  set before the kernels are decorated, and must not leak into the rest of the
  test session, so this module re-runs itself in one subprocess with it set
  (``python -m tests.unit.test_quant_kernels --device cpu`` runs the same checks
  by hand);
* the compiled kernels on CUDA, in a subprocess without the interpreter,
  whenever a GPU is present;
* an ahead-of-time compile of every kernel variant for sm_90 (no GPU needed):
  catches what the interpreter accepts but the compiler rejects.

The reference's own contract (dispatch switch, block-mean order, errors) is
tested in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gefen_titan.optim.quant import requant as quant
from gefen_titan.optim.quant.requant import Segment

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]


# --------------------------------------------------------------- helpers
def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so -0.0 != 0.0 and NaN payloads count."""
    t = t.detach().contiguous()
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}.get(t.dtype)
    return t.view(view) if view is not None else t


def same(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            same(a[k], b[k], f"{what}[{k}]")
        return
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{i}]")
        return
    if not isinstance(a, torch.Tensor):
        assert a == b, f"{what}: {a!r} != {b!r}"
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, (
        f"{what}: {a.dtype}{tuple(a.shape)}@{a.device} vs {b.dtype}{tuple(b.shape)}@{b.device}")
    diff = (_bits(a) != _bits(b)).reshape(-1)
    if a.is_floating_point():  # NaN payloads are not part of the contract (torch's own differ by code path)
        diff &= ~(a.isnan() & b.isnan()).reshape(-1)
    if diff.any():
        i = int(diff.nonzero()[0])
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at {i}: "
                             f"kernel {a.reshape(-1)[i].item()!r} vs reference {b.reshape(-1)[i].item()!r}")


def both(fn, what: str):
    """fn() with the kernels and with the reference; asserts the same bits (or the same error)."""
    out = {}
    for mode in ("triton", "reference"):
        with quant.use_backend(mode):
            try:
                out[mode] = ("ok", fn())
            except ValueError as e:
                out[mode] = ("ValueError", str(e))
    k, r = out["triton"], out["reference"]
    kernel, ref = (k[1] if k[0] != "ok" else ""), (r[1] if r[0] != "ok" else "")
    assert k[0] == r[0], f"{what}: kernel gave {k[0]} ({kernel}), reference {r[0]} ({ref})"
    if k[0] == "ok":
        same(k[1], r[1], what)
    else:
        assert k[1] == r[1], f"{what}: {k[1]!r} != {r[1]!r}"
    return r


def _codebook(g, device, duplicates=False):
    cb = torch.sort(torch.rand(256, generator=g) * 2 - 1).values
    cb[0], cb[-1] = -1.0, 1.0
    if duplicates:  # Gefen pads a small codebook with copies of its last centre
        cb[3:200] = cb[3]
        cb[210:230] = 0.0
        cb = torch.sort(cb).values
    return cb.to(device)


def _segments(g, device, spec, duplicates=False, scale=None):
    """Segments from (length, period, start) triples, each with its own codebook and blocks."""
    segs = []
    for length, period, start in spec:
        nb = (start + length + period - 1) // period + 1  # one spare block: the slice must be taken
        mag = (torch.rand(nb, generator=g) * 3 if scale is None
               else torch.full((nb,), scale) * (1 + torch.rand(nb, generator=g)))
        vmean = torch.rand(nb, generator=g) * 1e-3
        segs.append(Segment(length, period, start, _codebook(g, device, duplicates), mag.to(device), vmean.to(device)))
    return segs


# --------------------------------------------------------------- cases
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def requantize_random(device):
    g = torch.Generator().manual_seed(1)
    cb = _codebook(g, device)
    # periods around the kernel's tile (2048): one chunk, exactly a tile, several chunks
    for period, nblocks in [(1, 4099), (3, 1001), (7, 300), (64, 65), (100, 37), (256, 9), (2048, 3), (2049, 2),
                            (5000, 2)]:
        d = (torch.randn(period * nblocks, generator=g) * torch.rand(period * nblocks, generator=g) ** 4).to(device)
        both(lambda: quant.requantize(d, cb, period), f"random period {period}")


@case
def requantize_ties(device):
    # Codewords on a 1/128 grid: every midpoint is exactly representable.
    cb = torch.arange(-128, 128, dtype=torch.float32) / 128
    cb[-1] = 1.0
    cb = cb.to(device)
    mids = ((cb[1:] + cb[:-1]) / 2).cpu()
    x = torch.cat([mids, cb.cpu(), -mids, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    period = 8
    x = torch.cat([x, torch.zeros((-x.numel()) % period)]).reshape(-1, period)
    x[:, 0] = 1.0  # magnitude 1: x = m / 1 exactly, ties stay ties
    codes, _ = both(lambda: quant.requantize(x.reshape(-1).to(device), cb, period), "ties")[1]
    # and the tie rule itself (lower index) holds
    flat = x.reshape(-1).to(device)
    at_mid = torch.isin(flat, mids.to(device))
    left = torch.searchsorted(cb, flat[at_mid]) - 1
    assert torch.equal(codes.reshape(-1)[at_mid].long(), left), "ties must go to the lower index"


@case
def requantize_duplicate_codewords(device):
    g = torch.Generator().manual_seed(2)
    cb = _codebook(g, device, duplicates=True)
    vals = torch.cat([cb.cpu(), (cb.cpu()[1:] + cb.cpu()[:-1]) / 2, torch.rand(500, generator=g) * 2 - 1])
    period = 16
    vals = torch.cat([vals, torch.ones((-vals.numel()) % period)])
    both(lambda: quant.requantize(vals.to(device), cb, period), "duplicate codewords")


@case
def requantize_zeros_equal_signs(device):
    g = torch.Generator().manual_seed(3)
    cb = _codebook(g, device)
    period = 12
    blocks = [torch.zeros(period), -torch.zeros(period), torch.full((period,), 0.37), torch.full((period,), -2.5),
              torch.tensor([0.0, -0.0] * (period // 2)), torch.randn(period, generator=g)]
    d = torch.cat(blocks * 3).to(device)
    both(lambda: quant.requantize(d, cb, period), "zeros / all-equal / signed zeros")


@case
def requantize_extreme_magnitudes(device):
    g = torch.Generator().manual_seed(4)
    cb = _codebook(g, device)
    period = 33
    for scale in (1e-30, 1e30, 1e-38, 1e-42, 3e38):  # tiny, huge, near/below the normal range, near max
        d = (torch.randn(period * 50, generator=g) * scale).to(device)
        both(lambda: quant.requantize(d, cb, period), f"scale {scale}")
    d = torch.randn(period * 40, generator=g).to(torch.bfloat16).to(device)
    both(lambda: quant.requantize(d, cb, period), "bf16 input")


@case
def requantize_rejects_nonfinite(device):
    g = torch.Generator().manual_seed(5)
    cb = _codebook(g, device)
    for period, nblocks in [(10, 30), (3000, 2)]:  # one-chunk and two-pass kernels
        for bad in (float("nan"), float("inf"), float("-inf")):
            for where in (0, period * nblocks - 1, period + 2500 % period):
                d = torch.randn(period * nblocks, generator=g)
                d[where] = bad
                status, msg = both(lambda: quant.requantize(d.to(device), cb, period), f"{bad} at {where}")
                assert status == "ValueError" and "non-finite" in msg


@case
def dequantize_segments_mixed(device):
    g = torch.Generator().manual_seed(6)
    specs = [
        [(5003, 128, 0)],  # one segment, length not a multiple of block or tile
        [(1000, 64, 17), (37, 5, 0), (5003, 128, 130), (1, 3, 2), (777, 1000, 999)],  # phases, periods
        # 9 segments: a table of 16
        [(300 + 7 * i, p, (i * 13) % p) for i, p in enumerate([1, 2, 3, 8, 100, 256, 4096, 7, 9])],
        [(1, 1, 0)],
    ]
    for spec in specs:
        segs = _segments(g, device, spec)
        n = sum(s[0] for s in spec)
        codes = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device)
        for dtype in (torch.float32, torch.bfloat16):
            both(lambda: quant.dequantize_segments(codes, segs, dtype), f"{len(spec)} segments {dtype}")
    for scale in (1e-30, 1e30, 1e-38, 1e38, 3e38):  # 3e38 * (1 + rand) overflows to inf: inf and NaN products
        segs = _segments(g, device, [(999, 10, 5), (1001, 7, 3)], duplicates=True, scale=scale)
        codes = torch.randint(0, 256, (2000,), generator=g, dtype=torch.uint8).to(device)
        for dtype in (torch.float32, torch.bfloat16):
            both(lambda: quant.dequantize_segments(codes, segs, dtype), f"scale {scale} {dtype}")


@case
def dequantize_matches_single_segment_api(device):
    g = torch.Generator().manual_seed(7)
    (seg,) = _segments(g, device, [(4321, 100, 77)])
    codes = torch.randint(0, 256, (4321,), generator=g, dtype=torch.uint8).to(device)
    with quant.use_backend("triton"):
        k = quant.dequantize_segments(codes, [seg])
    same(k, quant.dequantize(codes, seg.codebook, seg.magnitude, 100, start=77), "vs quant.dequantize")


@case
def block_mean_segments_cases(device):
    g = torch.Generator().manual_seed(8)
    spec = [(1000, 64, 17), (37, 5, 0), (5003, 128, 130), (1, 3, 2), (777, 1000, 999)]  # 6818 = 2 * 7 * 487
    segs = _segments(g, device, spec)
    for period in (1, 2, 7, 14, 487, 974, 3409, 6818):  # 3409 / 6818: several MEAN_CHUNK chunks
        both(lambda: quant.block_mean_segments(segs, period), f"block mean period {period}")
    # target blocks inside source blocks: the source value exactly
    segs = _segments(g, device, [(640, 64, 64), (384, 128, 0)])
    with quant.use_backend("triton"):
        k = quant.block_mean_segments(segs, 32)
    want = torch.cat([quant.expand_blocks(s.vmean, s.period, s.start, s.start + s.length) for s in segs])[::32]
    same(k.reshape(-1), want, "exact blocks")
    for scale in (1e-30, 1e30):
        segs = _segments(g, device, [(600, 6, 1), (600, 10, 5)])
        segs = [Segment(s.length, s.period, s.start, vmean=s.vmean * scale) for s in segs]
        both(lambda: quant.block_mean_segments(segs, 40), f"block mean scale {scale}")


def _build_slot(device, region, sources, g):
    """The adapter's own slot rebuild on synthetic records."""
    from gefen_titan.optim.kinds.gefen.per_rank import GefenPerRankAdapter
    from gefen_titan.optim.kinds.gefen.per_rank_plan import Source
    from gefen_titan.optim.kinds.gefen.per_rank_regions import Region

    srcs, codebooks, blocks_of = [], {}, {}
    for label, (start, length, period) in enumerate(sources):
        srcs.append(Source(label, start, length, period, 7, 7, "opt"))
        codebooks[("opt", label)] = _codebook(g, device)
        nb = length // period
        blocks_of[("w", label)] = torch.stack([torch.rand(nb, generator=g) * 2,
                                               torch.rand(nb, generator=g) * 1e-4], 1).to(device)
    r = Region(0, 1, *region)
    needed = [s for s in srcs if s.start < r.stop and r.start < s.stop]
    plan = SimpleNamespace(needed={"w": needed}, codebooks=codebooks)
    slot = SimpleNamespace(fqn="w", region=r)
    codes = torch.randint(0, 256, (r.length,), generator=g, dtype=torch.uint8).to(device)
    cb = _codebook(g, device)
    return lambda: GefenPerRankAdapter._build_slot(None, plan, slot, codes, blocks_of, cb, None)


@case
def adapter_build_slot(device):
    g = torch.Generator().manual_seed(9)
    scenarios = {
        "merge, re-blocked with averaged vmean": ((0, 3000), [(0, 1000, 100), (1000, 1000, 40), (2000, 1000, 250)]),
        "merge on whole blocks": ((0, 4096), [(0, 2048, 64), (2048, 2048, 128)]),
        "uneven split cutting blocks": ((150, 2000), [(0, 1200, 100), (1200, 1200, 100)]),
        "long blocks, exact": ((0, 12000), [(0, 6000, 3000), (6000, 6000, 2000)]),
        "long blocks, averaged over two mean chunks": ((50, 6000), [(0, 3050, 3050), (3050, 3050, 1525)]),
    }
    for what, (region, sources) in scenarios.items():
        build = _build_slot(device, region, sources, g)
        state = both(build, what)[1]
        assert state["m_codebook"].dtype == torch.uint8 and state["vmean"].shape == state["m_magnitude"].shape


# --------------------------------------------------------------- subprocess runner
def run_cases(device: str) -> dict[str, str]:
    results = {}
    for name, fn in CASES.items():
        try:
            fn(torch.device(device))
            results[name] = "ok"
        except Exception:  # reported per case by the parent
            results[name] = traceback.format_exc()
    return results


def _run_child(device: str, interpret: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", quant.ENV)}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(HERE), "--device", device], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    if proc.returncode or not lines:
        pytest.fail(f"kernel check subprocess failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.fixture(scope="module")
def interpreted():
    return _run_child("cpu", interpret=True)


@pytest.fixture(scope="module")
def on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA absent: compiled kernels are checked on a GPU only "
                    "(the interpreter tests cover the kernel code)")
    return _run_child("cuda", interpret=False)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference_interpreter(interpreted, name):
    assert interpreted[name] == "ok", interpreted[name]


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference_cuda(on_cuda, name):
    assert on_cuda[name] == "ok", on_cuda[name]


def test_kernels_compile_for_sm90():
    """Every kernel variant compiles to a cubin for H100/H200 (no GPU needed)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from gefen_titan.optim.quant import kernels as K
    except ImportError as e:
        pytest.skip(f"triton's compiler is unavailable: {e}")
    if K.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are interpreted, not compiled")
    import triton

    ptr, idx = "*fp32", "i32"
    deq = dict(codes_ptr="*u8", table_ptr="*i32", codebooks_ptr=ptr, values_ptr=ptr, out_ptr=ptr, n=idx)
    req = dict(dense_ptr=ptr, codebook_ptr=ptr, codes_ptr="*u8", mag_ptr=ptr, flag_ptr="*i32", nblocks=idx, period=idx)
    mean = dict(table_ptr="*i32", values_ptr=ptr, out_ptr=ptr, nblocks=idx, period=idx)
    wide = dict(table_ptr="*i64", n="i64", nblocks="i64", period="i64")
    variants = [
        (K._dequantize_kernel, deq, dict(NP=4, LOG2NP=2, BLOCK=2048, WIDE=False, BF16=False)),
        (K._dequantize_kernel, {**deq, **{k: wide[k] for k in ("table_ptr", "n")}, "out_ptr": "*i16"},
         dict(NP=1, LOG2NP=0, BLOCK=2048, WIDE=True, BF16=True)),
        (K._requantize_kernel, req, dict(ROWS=16, C=128, ONE_CHUNK=True, WIDE=False)),
        (K._requantize_kernel, {**req, "dense_ptr": "*bf16", "nblocks": "i64", "period": "i64"},
         dict(ROWS=1, C=2048, ONE_CHUNK=False, WIDE=True)),
        (K._block_mean_kernel, mean, dict(NP=8, LOG2NP=3, ROWS=2, C=1024, LOG2C=10, WIDE=False)),
        (K._block_mean_kernel, mean, dict(NP=1, LOG2NP=0, ROWS=2048, C=1, LOG2C=0, WIDE=False)),
    ]
    for fn, sig, const in variants:
        sig = {**sig, **{k: "constexpr" for k in const}}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert compiled.asm.get("cubin"), fn.__name__
        # the float divisions are IEEE round-to-nearest, nothing is flushed or contracted
        banned = ("div.full", "div.approx", ".ftz", "fma.rn.f32")
        assert not any(b in ptx for b in banned), fn.__name__


# --------------------------------------------------------------- the reference's own contract
def test_backend_switch(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv(quant.ENV, raising=False)
    assert quant.backend_for(cpu) == "reference"  # auto: the reference off CUDA
    monkeypatch.setenv(quant.ENV, "reference")
    assert quant.backend_for(cpu) == "reference"
    with quant.use_backend("auto"):
        assert quant.backend_for(cpu) == "reference"
    monkeypatch.setenv(quant.ENV, "bogus")
    with pytest.raises(ValueError, match="GEFEN_TITAN_KERNELS"):
        quant.backend_for(cpu)
    with quant.use_backend("reference"):  # the function overrides the variable
        assert quant.backend_for(cpu) == "reference"
    with pytest.raises(ValueError):
        quant.set_backend("cuda")
    monkeypatch.delenv(quant.ENV)
    from gefen_titan.optim.quant import kernels

    with quant.use_backend("triton"):
        if kernels.INTERPRETED:
            assert quant.backend_for(cpu) == "triton"
        else:
            with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
                quant.backend_for(cpu)
    if torch.cuda.is_available():
        assert quant.backend_for(cpu.cuda()) == "triton"


def test_block_mean_order_and_exactness():
    g = torch.Generator().manual_seed(10)
    v = torch.rand(6, 3000, generator=g)
    got = quant.block_mean(v.reshape(-1), 3000)
    assert torch.allclose(got.reshape(-1), v.double().mean(1).float(), rtol=1e-6, atol=0)
    # constant blocks give their value exactly (a sum / n would not always)
    c = torch.tensor([0.1, 1 / 3, 7e-5]).repeat_interleave(3).reshape(3, 3)
    assert torch.equal(quant.block_mean(c.reshape(-1), 3).reshape(-1), c[:, 0])
    # the documented order: chunk pairwise trees, chunk sums left to right, / period
    x = torch.rand(2500, generator=g)
    pad = torch.cat([x, torch.zeros(3 * 1024 - 2500)]).reshape(3, 1024)
    while pad.shape[1] > 1:
        pad = pad[:, 0::2] + pad[:, 1::2]
    total = torch.zeros(()) + pad[0, 0]
    total = (total + pad[1, 0]) + pad[2, 0]
    assert torch.equal(quant.block_mean(x, 2500).reshape(()), total / torch.tensor(2500.0))


def test_reference_requantize_contract():
    cb = torch.linspace(-1, 1, 256)
    with pytest.raises(ValueError, match="non-finite"):
        quant.requantize(torch.tensor([1.0, float("nan")]), cb, 2)
    with pytest.raises(ValueError, match="whole blocks"):
        quant.requantize(torch.zeros(5), cb, 2)
    codes, mag = quant.requantize(torch.tensor([0.0, 0.0, 2.0, -1.0]), cb, 2)
    assert codes.shape == (2, 2) and codes.dtype == torch.uint8 and mag.reshape(-1).tolist() == [0.0, 2.0]
    assert codes[1, 0] == 255 and (cb[codes[1, 1].long()] + 0.5).abs() == (cb + 0.5).abs().min()


def test_reference_segments_contract():
    g = torch.Generator().manual_seed(11)
    segs = _segments(g, torch.device("cpu"), [(10, 4, 3), (6, 2, 0)])
    codes = torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8)
    whole = quant.dequantize_segments(codes, segs)
    parts = [quant.dequantize(codes[:10], segs[0].codebook, segs[0].magnitude, 4, 3),
             quant.dequantize(codes[10:], segs[1].codebook, segs[1].magnitude, 2, 0)]
    assert torch.equal(whole, torch.cat(parts))
    with pytest.raises(ValueError, match="cover"):
        quant.dequantize_segments(codes[:15], segs)
    assert quant.dequantize_segments(codes, segs, torch.float16).dtype == torch.float16  # reference handles any dtype


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy under the interpreter, on inf/NaN cases
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    results = run_cases(device)
    for name, res in results.items():
        print(f"{name}: {'ok' if res == 'ok' else 'FAILED'}", file=sys.stderr)
        if res != "ok":
            print(res, file=sys.stderr)
    print("RESULTS " + json.dumps(results))
