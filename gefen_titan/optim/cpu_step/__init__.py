"""Gefen's step on the CPU at about AdamW's cost, bit for bit gefen-x 0.5.0's.

gefen-x runs its step on CPU tensors as a chain of pure-torch ops (its fused
kernels need CUDA): about 100x torch's fused AdamW, most of it in
``searchsorted``. ``kernel.cpp`` does the same arithmetic in one pass per
block row, with every rounding torch makes (``docs/cpu_step.md``);
``tests/unit/test_cpu_step.py`` holds it to gefen-x's own step bit for bit.

* ``build``: compiles the kernel on first use and caches it per machine (an
  AVX2 build, or a portable one for hosts without AVX2), or says why it cannot
  (no compiler);
* ``probe``: asks the installed torch which roundings the kernel must follow
  in this process (its sum order, whether its lerp is fused);
* ``codebook``: a codebook's nearest-codeword rule as thresholds and a table;
* ``steps``: the per-parameter steps the kernel takes and those it hands back
  (and ``factored_momentum(optim)``: the momentum update alone, for the factored
  second moment's step);
* ``install(optim, mode)``: what the registry's factories call on every Gefen
  and GefenMuon they build. ``mode`` is the kind's ``cpu_step`` option: ``"kernel"``
  (the default) or ``"gefen-x"`` (gefen-x's own path, always).

CPU offload (``--training.enable_cpu_offload``) runs the step on the host,
so there the kernel is what makes it usable.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.optim import Optimizer
from torchtitan.tools.logging import logger

from gefen_titan.distributed import local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.cpu_step import probe
from gefen_titan.optim.cpu_step.build import Built, Library, Unavailable, load
from gefen_titan.optim.cpu_step.steps import GefenMomentum, GefenStep, MuonMomentum

__all__ = ["MODES", "checked", "factored_momentum", "install", "kernel", "routed_step"]

MODES = ("kernel", "gefen-x")

_lock = threading.Lock()
_checked: Library | Unavailable | None = None


def _self_check(lib: Library) -> str | None:
    """Step a small Gefen both ways on this machine; what differs, or None. Guards the facts the kernel
    rests on (torch's roundings as ``probe`` found them, and the rest) on CPUs the tests did not run on."""
    gen = torch.Generator().manual_seed(0)
    codebook = torch.sort(torch.rand(256, generator=gen) * 2 - 1).values
    codebook[0], codebook[-1] = -1.0, 1.0
    init = torch.randn(37, 12, generator=gen)
    grads = [torch.randn(37, 12, generator=gen) * 1e-2 for _ in range(3)]
    runs = []
    for routed in (False, True):
        p = torch.nn.Parameter(init.clone())
        optim = gx.new_gefen([{"params": [("w", p)], "lr": 1e-2, "weight_decay": 0.1}], fused=False,
                             factored_v_2d=False)
        gx.set_codebook(optim, codebook.clone())
        gx.set_period(optim, p, 12)
        step = GefenStep(optim, lib)
        if routed:
            gx.route_cpu_step(optim, step)
        for g in grads:
            p.grad = g.clone()
            optim.step()
        if routed and step.taken != len(grads) - 1:
            return f"the kernel took {step.taken} of {len(grads) - 1} steps ({dict(step.declined)})"
        st = gx.gefen_read(optim, p)
        runs.append((p.detach(), st.codes, st.magnitude, st.vmean))
    names = ("parameter", "codes", "magnitudes", "vmean")
    differ = [n for n, a, b in zip(names, *runs) if not torch.equal(a.view(torch.uint8), b.view(torch.uint8))]
    if differ:
        return f"its {', '.join(differ)} differ from gefen-x's on this machine"
    return _momentum_check(lib, codebook, [g.view(-1, 12) for g in grads])


def _momentum_check(lib: Library, codebook: torch.Tensor, grads: list[torch.Tensor]) -> str | None:
    """The factored step's momentum update alone (``GefenMomentum``) both ways from a zero state; what
    differs, or None."""
    runs = []
    for routed in (False, True):
        p = torch.nn.Parameter(torch.zeros_like(grads[0]))
        optim = gx.new_gefen([{"params": [("w", p)], "lr": 1e-2}], fused=False, factored_v_2d=False)
        gx.set_codebook(optim, codebook.clone())
        gx.set_period(optim, p, p.shape[1])
        gx.gefen_factored_init(optim, p, grads[0], (p.shape[0],), (p.shape[1],))
        momentum = GefenMomentum(optim, lib)
        for g in grads:
            m = momentum(p, g, 0.9) if routed else gx.gefen_momentum_update(optim, p, g, 0.9)
            if m is None:
                return f"the kernel declined the momentum update ({dict(momentum.declined)})"
        st = gx.gefen_read(optim, p)
        runs.append((m, st.codes, st.magnitude))
    names = ("dense momentum", "codes", "magnitudes")
    differ = [n for n, a, b in zip(names, *runs) if not torch.equal(a.view(torch.uint8), b.view(torch.uint8))]
    return f"its momentum update's {', '.join(differ)} differ from gefen-x's on this machine" if differ else None


def checked(built: Built | Unavailable) -> Library | Unavailable:
    """``built`` set to follow this process's torch (``probe``) and stepped against gefen-x, or why it cannot
    run here."""
    if isinstance(built, Unavailable):
        return built
    found = probe.probe(built)
    if isinstance(found, str):
        return Unavailable(f"the kernel cannot follow this torch's roundings: {found}")
    lib = built.follow(found.sum_width, found.sum_width_f64, found.fused)
    wrong = _self_check(lib)
    return Unavailable(f"the kernel's self-check failed: {wrong}") if wrong else lib


def kernel() -> Library | Unavailable:
    """The loaded kernel, checked against torch and gefen-x once per process, or why it cannot run here."""
    global _checked
    with _lock:
        if _checked is None:
            lib = checked(load())
            _checked = lib
            if isinstance(lib, Unavailable):
                logger.warning(f"gefen-titan CPU step: gefen-x's own path (about 100x slower), because {lib.reason}")
        return _checked


def routed_step(optim: Optimizer) -> GefenStep | MuonMomentum | None:
    """The kernel step ``install`` routed ``optim`` through, None if it runs gefen-x's own."""
    return _ROUTED.get(optim)


def factored_momentum(optim: Optimizer) -> GefenMomentum | None:
    """The kernel's Gefen momentum update alone for ``optim`` (the factored second moment's step calls it, and
    gefen-x's ``gefenx.gefen_momentum_update`` where it returns None), None if ``optim`` runs gefen-x's own."""
    step = _ROUTED.get(optim)
    return step.momentum if isinstance(step, GefenStep) else None


_ROUTED: weakref.WeakKeyDictionary[Optimizer, GefenStep | MuonMomentum] = weakref.WeakKeyDictionary()


def _devices(optim: Optimizer) -> str:
    kinds = sorted({local(p).device.type for g in optim.param_groups for p in g["params"]})
    return "/".join(kinds) or "no"


def install(optim: Optimizer, mode: str, label: str) -> str:
    """Route ``optim``'s CPU steps through the kernel (``mode="kernel"``, where it can run) or leave gefen-x's
    (``"gefen-x"``); log the path, once per optimizer, and return it."""
    if mode not in MODES:
        raise ValueError(f"optimizer.cpu_step must be one of {list(MODES)}, got {mode!r}")
    where = f"{label} ({_devices(optim)} parameters)"
    if mode == "gefen-x":
        path = "gefen-x's own step (optimizer.cpu_step = \"gefen-x\")"
    else:
        lib = kernel()
        if isinstance(lib, Unavailable):
            path = "gefen-x's own step (the kernel cannot run here: see the warning above)"
        else:
            step = MuonMomentum(optim, lib) if gx.is_gefen_muon(optim) else GefenStep(optim, lib)
            gx.route_cpu_step(optim, step)
            _ROUTED[optim] = step
            what = "momentum" if gx.is_gefen_muon(optim) else "step"
            path = (f"the exact CPU kernel for its {what} on CPU tensors ({lib.path.name}: {lib.isa} build, "
                    f"torch's sum order {lib.sum_width} lanes, {'fused' if lib.fused else 'unfused'} lerp); "
                    "CUDA tensors keep gefen-x's")
    logger.info(f"{where}: {path}")
    return path
