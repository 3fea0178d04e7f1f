"""The roundings of the installed torch that the kernel follows, asked of torch itself in this process.

The kernel reproduces gefen-x's step only if it rounds as torch does here,
and two of torch's roundings differ between torch builds and hosts:

* **The order of ``torch.mean(g * g, dim=1)``'s sum**: torch's cascade over
  vectors of W lanes (``SumKernel.cpp``). W is not the CPU's vector width,
  nor a function of the kernels' name: torch 2.13 sums fp32 rows in 8-lane
  order under its AVX512, AVX2 and DEFAULT kernels alike (measured on an
  AVX-512 Intel Xeon, recorded in ``tests/fixtures/cpu_step_avx512.pt``, and
  on an AVX-512 AMD EPYC), where mapping "AVX512" to 16 lanes made the
  kernel's self-check fail there. So W is found here: torch sums rows built
  so that every candidate order gives different bits, and the one candidate
  whose rendering (``kernel.cpp``'s, of torch's algorithm at W lanes) equals
  torch's on every row is torch's order. fp32 and double rows are probed
  apart (the kernel sums bf16 and fp16 squares in fp32 order, as torch does).
* **Whether ``lerp`` and ``add_(x, alpha)`` are one fused multiply-add**:
  they are in torch's AVX2 and AVX-512 kernels (vector loop and scalar tail),
  and are two roundings in its DEFAULT kernels on x86
  (``ATEN_CPU_CAPABILITY=default``).

Where torch matches no candidate, or the probe cannot tell candidates apart,
the kernel does not run (``probe`` returns why) and gefen-x's own step does.
It costs a few milliseconds once per process; it is not cached with the
build, because the same library serves processes whose torch dispatches
differently (``ATEN_CPU_CAPABILITY``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from gefen_titan.optim.cpu_step.build import Built

__all__ = ["CANDIDATE_WIDTHS", "Observation", "TorchRoundings", "fused_of", "observe", "probe", "probe_rows",
           "renderings", "width_of"]

# The sum orders the kernel renders (lanes per vector): NEON's 4 floats, AVX2's 8, AVX-512's 16, and the
# halves and doubles of them for double rows.
CANDIDATE_WIDTHS = (2, 4, 8, 16, 32)
_CODES = {torch.float32: 0, torch.float64: 3}  # kernel.cpp's DType


@dataclass(frozen=True)
class TorchRoundings:
    sum_width: int  # lanes of torch's sum order for fp32 rows
    sum_width_f64: int  # and for double rows
    fused: bool  # lerp and add_(alpha) round once


@dataclass(frozen=True)
class Observation:
    """Rows ``g`` (fp32 or fp64, 2-D) and torch's ``(g * g).sum(dim=1)`` of them."""

    g: torch.Tensor
    sums: torch.Tensor


def probe_rows(dtype: torch.dtype) -> list[torch.Tensor]:
    """Rows whose squares span 2^-24..2^24, so that the rounding of every partial sum shows: lengths below,
    at and far above each candidate's vectors and levels, with ragged tails."""
    gen = torch.Generator().manual_seed(20261206)
    rows = []
    for n in (67, 300, 1000, 4099):
        scale = torch.exp2(torch.randint(-12, 13, (6, n), generator=gen).to(torch.float64))
        rows.append((torch.randn(6, n, generator=gen, dtype=torch.float64) * scale).to(dtype))
    return rows


def observe(dtype: torch.dtype) -> list[Observation]:
    """torch's own sums of squares of ``probe_rows(dtype)``, computed as gefen-x's ``torch.mean(g * g, dim=1)``
    sums (on CPU, ``mean`` is ``sum`` then one division)."""
    return [Observation(g, (g * g).sum(dim=1)) for g in probe_rows(dtype)]


def renderings(built: Built, g: torch.Tensor, width: int) -> torch.Tensor:
    """The kernel's plain rendering of torch's sum order at ``width`` lanes, per row of ``g``, in g's dtype."""
    g = g.contiguous()
    out, got = ctypes.c_double(), []
    row_bytes = g.shape[1] * g.element_size()
    for r in range(g.shape[0]):
        if built.lib.gt_row_sumsq(g.data_ptr() + r * row_bytes, g.shape[1], _CODES[g.dtype], width, 0,
                                  ctypes.byref(out)) != 0:
            raise RuntimeError(f"gt_row_sumsq refused width {width} for {g.dtype}")
        got.append(out.value)
    return torch.tensor(got, dtype=torch.float64).to(g.dtype)


def width_of(built: Built, observed: list[Observation]) -> int | str:
    """The one candidate width whose rendering equals torch's sums on every observed row, or why there is none."""
    matching = []
    told_apart = {}
    for width in CANDIDATE_WIDTHS:
        rendered = [renderings(built, o.g, width) for o in observed]
        told_apart[width] = rendered
        if all(torch.equal(r.view(-1), o.sums.reshape(-1)) for r, o in zip(rendered, observed)):
            matching.append(width)
    dtype = observed[0].g.dtype
    if len(matching) == 1:
        return matching[0]
    if not matching:
        return (f"torch's {dtype} row sums here follow none of the orders the kernel renders (vectors of "
                f"{', '.join(map(str, CANDIDATE_WIDTHS))} lanes)")
    return f"the probe rows cannot tell torch's {dtype} sum orders of {matching} lanes apart"


def fused_of() -> bool | str:
    """Whether torch's ``lerp`` (both of its branches) and ``add_(x, alpha)`` round once here (True), twice
    (False), or why neither: compared with float64 renderings of both, on values where they differ."""
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(2, 1003, generator=gen)
    verdicts = set()
    for w in (0.1, 0.9):  # torch's two lerp branches: w * (b - a) + a, and b - (1 - w) * (b - a)
        got = torch.lerp(a, b, w)
        wf = float(np.float32(w))
        diff = (b - a).double()  # one float rounding, as torch's
        if w < 0.5:
            fused, two = (a.double() + wf * diff).float(), (a + (wf * diff).float()).float()
        else:
            omw = float(np.float32(1.0) - np.float32(wf))
            fused, two = (b.double() - omw * diff).float(), (b - (omw * diff).float()).float()
        verdicts.add("fused" if torch.equal(got, fused) else "two" if torch.equal(got, two) else "neither")
    alpha = float(np.float32(0.3))
    got = a.clone().add_(b, alpha=0.3)
    fused, two = (a.double() + b.double() * alpha).float(), a + (b.double() * alpha).float()
    verdicts.add("fused" if torch.equal(got, fused) else "two" if torch.equal(got, two) else "neither")
    if verdicts == {"fused"}:
        return True
    if verdicts == {"two"}:
        return False
    return f"torch's lerp and add_(alpha) here round neither once nor twice throughout ({sorted(verdicts)})"


def probe(built: Built) -> TorchRoundings | str:
    """torch's roundings in this process, as the kernel must follow them, or why the kernel cannot."""
    widths = [width_of(built, observe(dtype)) for dtype in (torch.float32, torch.float64)]
    fused = fused_of()
    problems = [w for w in (*widths, fused) if isinstance(w, str)]
    if problems:
        return "; ".join(problems)
    return TorchRoundings(sum_width=widths[0], sum_width_f64=widths[1], fused=bool(fused))
