"""The one rule for a gefen-x constructor option given by any route: taken at its place, refused elsewhere.

A Gefen-family kind's options can be given three ways (``ROUTES``): its
table (``[optimizer.gefen]``, ``[optimizer.muon]``), torchtitan's
``optimizer_factory_kwargs_by_name.<name>`` (the factory's keyword
arguments), a param group's ``optimizer_kwargs``. The kind's registry entry
names its ``constructor`` (``gefenx.constructor``: every keyword of gefen-x's
constructor applied in the kind's table, routed to another place, or refused
with its reason); ``refusal`` says, for one key on one route, why it is not
taken there, or None where it is (or where the key is no gefen-x option,
which the route's own check reports). So each option has exactly one place;
given anywhere else it is refused with "set <place> instead" rather than
applied from two places (a value given twice could not say which was meant)
or handed to gefen-x as a keyword twice (a raw ``TypeError``).

Callers: the param groups' check (the recipe checks and the container's
Config run it: group keys and factory kwargs), the container before it
builds any optimizer (``refuse_factory_kwargs``: a container built without
the checks says the same) and the recipe layer's check of the tables' keys
(``table_refusal``, before its "unknown key").
"""

from __future__ import annotations

from typing import Any

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import registry

__all__ = ["ROUTES", "composite_factory_refusal", "refusal", "refuse_factory_kwargs", "table_refusal"]

ROUTES = ("table", "factory", "group")


def refusal(spec: registry.OptimizerSpec, key: str, route: str) -> str | None:
    """Why option ``key`` of the kind ``spec`` given by ``route`` is not taken there.

    None: it is taken there, or ``key`` is none of the kind's options (its
    constructor's keywords, its table's fields: the entry's ``option_keys``),
    or the kind classifies no gefen-x constructor (torch's optimizers).
    """
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r} (known: {', '.join(ROUTES)})")
    if spec.constructor is None:
        return None
    outcome = spec.constructor.options.get(key)
    option = f"gefen-x's {spec.name} option {key!r}"
    if isinstance(outcome, gx.Refused):
        return f"{option} is refused: {outcome.reason}. Remove it"
    if isinstance(outcome, gx.Routed):
        if route == "group" and key in spec.group_keys:
            return None
        return f"{option} is set at {outcome.place}: set it there instead"
    field = outcome.field if isinstance(outcome, gx.Applied) else key if key in spec.option_keys else None
    if field is not None:
        if route == "table":
            return None
        what = option if outcome is not None else f"{key!r}, gefen-titan's {spec.name} option,"
        return f"{what} applies to every {spec.name} optimizer of the run: set optimizer.{spec.options}.{field} instead"
    if route == "factory":
        return (f"{key!r} is no option of gefen-x's {spec.name} (its options: "
                f"{', '.join(sorted(spec.constructor.options))}); each has one place in a recipe (docs/recipes.md, "
                "'gefen-x's options')")
    return None


def refuse_factory_kwargs(factory_kwargs_by_name: dict[str, dict[str, Any]]) -> None:
    """Refuse (ValueError) every factory kwarg a registered kind does not take there, and any for a composite."""
    for name, kwargs in factory_kwargs_by_name.items():
        if (composite := registry.composite(name)) is not None:
            raise ValueError(composite_factory_refusal(composite, kwargs))
        if (spec := registry.get(name)) is None:
            continue
        refused = [f"optimizer_factory_kwargs_by_name.{name}.{key}: {why}" for key in kwargs
                   if (why := refusal(spec, key, "factory")) is not None]
        if refused:
            raise ValueError("; ".join(refused))


def composite_factory_refusal(composite: registry.CompositeSpec, kwargs: dict[str, Any]) -> str:
    """Why ``optimizer_factory_kwargs_by_name.<composite>`` is refused: the name is never built (it expands into
    its optimizers' groups), so no factory would take them; each key's place, where it has one."""
    places = []
    for key in kwargs:
        if key in composite.option_keys:
            places.append(f"{key}: set optimizer.{composite.options}.{key} instead")
        elif key in composite.refused_keys:
            places.append(f"{key}: gefen-x's {composite.name} option is not supported: {composite.refused_keys[key]}")
        elif key in registry.SHORTHAND_KEYS:
            places.append(f"{key}: set [optimizer] {key} instead")
    known = f" ({'; '.join(places)})" if places else ""
    return (f"optimizer_factory_kwargs_by_name.{composite.name}: {composite.name} is no optimizer at run time (it "
            f"expands into its optimizers' param groups), so nothing would take these{known}; its options are "
            f"[optimizer.{composite.options}], and lr, betas, eps, weight_decay are [optimizer]'s")


def table_refusal(table: str, key: str) -> str | None:
    """Why ``key`` set in a kind's table ``[optimizer.<table>]`` (or flat in ``[optimizer]``: ``table`` "") is
    not taken there: a gefen-x option of that kind (flat: of the first kind that classifies it) whose place is
    elsewhere or that is refused; None for any other key."""
    for spec in registry.specs():
        if table in ("", spec.options) and (why := refusal(spec, key, "table")) is not None:
            return why
    return None
