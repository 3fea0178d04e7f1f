"""Every keyword of a gefen-x constructor, classified: what gefen-titan does with it (``Constructor``).

A gefen-x option can reach an optimizer by three routes: the kind's table
(``[optimizer.gefen]``, ``[optimizer.muon]``), torchtitan's
``optimizer_factory_kwargs_by_name.<name>`` (keyword arguments of the
kind's factory) and a param group's ``optimizer_kwargs``. Each keyword of
the constructor is exactly one of:

* ``Applied(field)``: a field of the kind's table, which the container
  gives every optimizer of the kind (the registry entry's ``option_keys``);
* ``Routed(place)``: applied from another place gefen-titan already has for
  it (the shorthand and the param groups' keys, torchtitan's
  ``implementation``);
* ``Refused(reason)``: gefen-titan cannot keep it (its state would depend on
  the shard layout, or it is not supported yet).

``optim.option_routes`` is the rule over the routes: an option is taken at
its one place only; given by any other route it is refused at recipe/config
time, naming that place. Nothing passes silently, and nothing reaches gefen-x
as a keyword twice (its raw ``TypeError: got multiple values``).

Why the tables live in this package (each kind's beside its accessors:
``gefen.GEFEN_CONSTRUCTOR``, ``muon.MUON_CONSTRUCTOR``) and not in the
kinds' options modules: they are statements about gefen-x's constructors
(what each keyword does to the state and its layout, e.g. where stochastic
rounding draws its noise), checked against the real signatures
(``Constructor.unclassified``: a test fails on a gefen-x that grows a
keyword), next to the other gefen-x facts a gefen-x upgrade must review in
this one package. Constructor keywords are gefen-x's public API: nothing
here reads private state.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CAPTURABLE", "IMPLEMENTATION", "NOT_OPTIONS", "STOCHASTIC_ROUND", "VERBOSE", "Applied", "Constructor",
           "Refused", "Routed", "shorthand_place"]


@dataclass(frozen=True)
class Applied:
    """Set in the kind's own table as ``field``; the container gives it to every optimizer of the kind."""

    field: str


@dataclass(frozen=True)
class Routed:
    """Applied from ``place`` (a recipe key), which is where a recipe sets it."""

    place: str


@dataclass(frozen=True)
class Refused:
    """Not supported, for ``reason``."""

    reason: str


# The constructors' parameters that are no option: the optimizer itself and the param groups the container builds.
NOT_OPTIONS = ("self", "params")


@dataclass(frozen=True)
class Constructor:
    """One gefen-x class's constructor keywords (but ``NOT_OPTIONS``), each classified."""

    cls: type
    options: Mapping[str, Applied | Routed | Refused]

    def unclassified(self) -> list[str]:
        """The keywords of ``cls.__init__`` with no entry, and the entries that are no keyword ([] in step)."""
        keywords = {k for k in inspect.signature(self.cls.__init__).parameters if k not in NOT_OPTIONS}
        return sorted(keywords ^ set(self.options))


def shorthand_place(key: str) -> str:
    """Where a group hyperparameter that ``[optimizer]``'s shorthand can stand for is set."""
    return f"[optimizer] {key}, or a param group's optimizer_kwargs.{key}"


# Reasons and places the kinds' tables share.
IMPLEMENTATION = ("optimizer.implementation (torchtitan's: \"fused\" on CUDA, \"for-loop\" otherwise), or a "
                  "param group's optimizer_kwargs.fused")
STOCHASTIC_ROUND = ("on CUDA gefen-x draws its stochastic-rounding noise by the element's index inside the local "
                    "tensor, so the same step rounds differently at another shard layout, and a checkpoint could not "
                    "reshard exactly")
CAPTURABLE = "capturable keeps the step counters on the device, and gefen-titan checkpoints host counters"
VERBOSE = "gefen-titan logs through torchtitan's logger"
