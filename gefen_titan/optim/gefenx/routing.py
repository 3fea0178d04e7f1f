"""The hook of gefen_titan.optim.cpu_step's kernel into gefen-x's step.

gefen-x steps each parameter through a bound method: Gefen's whole step of
one parameter is ``_step_automatic(group, name, p, grad)``, GefenMuon's
momentum update ``_prepare_muon_momentum(group, name, p, grad, numel)``
(returning the state and the dense momentum). ``route_cpu_step`` replaces
that method on one optimizer by one that offers the parameter to the kernel
first and calls gefen-x's own where the kernel declines, so every caller of
``step()`` (torchtitan's container, the sharded GefenMuon step) gets it and
nothing else of gefen-x changes. ``tests/unit/test_cpu_step.py`` pins the
result bit for bit against gefen-x's own step (and fails if the methods are
renamed: the kernel would then take no step).
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from gefen_titan.optim.gefenx.muon import is_gefen_muon

__all__ = ["route_cpu_step", "route_gefen_step"]


def route_cpu_step(optim: Optimizer, step: Any) -> None:
    """Offer each parameter to ``step(group, p, grad)`` before gefen-x's own: Gefen's ``_step_automatic``
    (True: done), GefenMuon's ``_prepare_muon_momentum`` (the dense momentum); on False or None gefen-x's runs."""
    if is_gefen_muon(optim):
        own_m = optim._prepare_muon_momentum
        optim._prepare_muon_momentum = lambda group, name, p, grad, n: (
            own_m(group, name, p, grad, n) if (d := step(group, p, grad)) is None else (optim.state[p], d))
    else:
        route_gefen_step(optim, step)


def route_gefen_step(optim: Optimizer, step: Any) -> None:
    """Offer each parameter of a Gefen to ``step(group, p, grad)`` before what steps it now (True: done).

    The routes chain: the factored second moment's step (``optim.kinds.gefen.factored``), routed after the
    CPU kernel's, is offered each parameter first; what it declines goes on to the kernel, then to gefen-x.
    """
    own = optim._step_automatic
    optim._step_automatic = lambda group, name, p, grad: step(group, p, grad) or own(group, name, p, grad)
