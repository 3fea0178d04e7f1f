"""The container Config's options tables, generated from the registry, not written by hand.

How. A kind with options of its own names its ``[optimizer]`` table and
carries the table's class in its registry entry (``OptimizerSpec.options``
and ``options_type``; a composite's ``CompositeSpec`` alike), a dataclass of
``optim.options_table.OptionsTable``. Two pieces turn those into the
Config's fields:

* ``with_registered_tables``, a class decorator applied under ``@dataclass``
  (so it runs first), adds one annotated field per registered table,
  ``<table>: <options_type> = field(default_factory=<options_type>)``. The
  container's module registers the built-in kinds before it defines the
  Config, so ``gefen``, ``muon`` and ``hybrid`` are ordinary static dataclass
  fields from import on: tyro lists and parses them as any other
  (``--optimizer.gefen.cpu-step gefen-x``), and the FT variant's Config
  inherits them. tyro takes a field's help from its docstring in the source,
  which a generated field has not; it then shows the field's type's
  docstring, so an options class's docstring is its table's help.
* ``config_class(base)`` is ``base`` when every registered table is already
  a field of it, else a subclass of it (``dataclasses.make_dataclass``,
  kw_only and slots as the Config, one per set of added tables, cached) that
  adds the tables of kinds registered after the Config was defined (a
  test's, a plugin's). ``GefenOptimizersContainer.config_class()`` calls it
  on its own Config (and the FT container's on its), and the recipe layer
  builds ``[optimizer]`` through it, so such a kind's ``[optimizer.<table>]``
  is read and reaches its factory.

``table(config, name)`` is how the container reads a kind's table: a Config
without it (built from the class as it was before the kind was registered)
is one clear error saying to build it with ``config_class()``.
``flat_keys(tables)`` is the recipe layer's map of older recipes' flat
``[optimizer]`` keys, from every table's ``FLAT_KEYS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from gefen_titan.optim import registry
from gefen_titan.optim.options_table import OptionsTable

__all__ = ["config_class", "flat_keys", "scalar_fields", "table", "tables_of", "with_registered_tables"]

T = TypeVar("T", bound=type)

_GENERATED: dict[tuple[type, tuple[tuple[str, type], ...]], type] = {}


def _field(options_type: type[OptionsTable]) -> Any:
    return dataclasses.field(default_factory=options_type)


def with_registered_tables(cls: T) -> T:
    """Add one field per registered options table that ``cls`` does not declare (see the module docstring).
    Apply it under ``@dataclass``; the tables' names must be free (no other field of that name)."""
    annotations = cls.__dict__.get("__annotations__")
    if annotations is None:
        cls.__annotations__ = annotations = {}
    for name, options_type in registry.option_tables().items():
        if name in annotations:
            continue
        annotations[name] = options_type
        setattr(cls, name, _field(options_type))
    return cls


def _fields(config_type: type) -> set[str]:
    return {f.name for f in dataclasses.fields(config_type)}


def config_class(base: T) -> T:
    """``base`` (a Config dataclass) if it has a field for every registered table, else its
    generated subclass with the missing ones (cached per set of tables)."""
    have = _fields(base)
    missing = tuple((n, t) for n, t in registry.option_tables().items() if n not in have)
    if not missing:
        return base
    key = (base, missing)
    if key not in _GENERATED:
        name = f"{base.__name__}With{''.join(n.title().replace('_', '') for n, _ in missing)}"
        cls = dataclasses.make_dataclass(name, [(n, t, _field(t)) for n, t in missing], bases=(base,),
                                         kw_only=True, slots=True)
        cls.__module__ = base.__module__
        cls.__qualname__ = f"{base.__qualname__.rpartition('.')[0] or base.__qualname__}.{name}"
        cls.__doc__ = (f"{base.__qualname__} with the tables of kinds registered after it was defined: "
                       f"{', '.join('optimizer.' + n for n, _ in missing)} (``optim.config_tables``).")
        _GENERATED[key] = cls
    return _GENERATED[key]


def table(config: Any, name: str) -> OptionsTable:
    """``config``'s ``[optimizer.<name>]`` table; a ValueError if its class has none."""
    if name not in _fields(type(config)):
        raise ValueError(
            f"optimizer.{name}: this optimizer config ({type(config).__qualname__}) has no table {name!r}: "
            "its kind was registered after the Config class was defined; build the config with "
            "GefenOptimizersContainer.config_class() (the recipe layer does), which adds the tables of every "
            "registered kind")
    return getattr(config, name)


def tables_of(config: Any, own: dict[str, type[OptionsTable]]) -> dict[str, OptionsTable]:
    """The options tables ``config`` holds: the container's ``own`` and the registered kinds' it has a field for."""
    have = _fields(type(config))
    return {n: getattr(config, n) for n in (*own, *registry.option_tables()) if n in have}


def flat_keys(own: dict[str, type[OptionsTable]]) -> dict[str, list[str]]:
    """A flat ``[optimizer]`` key of recipes written before the tables -> the ``table.field`` places it
    sets, from the ``FLAT_KEYS`` of the container's ``own`` tables and every registered one."""
    places: dict[str, list[str]] = {}
    for name, options in {**own, **registry.option_tables()}.items():
        for old, new in options.FLAT_KEYS.items():
            places.setdefault(old, []).append(f"{name}.{new}")
    return places


def scalar_fields(own: dict[str, type[OptionsTable]]) -> dict[str, str]:
    """A table whose older spelling is a plain value where the table now is -> the field it sets
    (``[optimizer] blocking = "per_rank"``: ``blocking.mode``)."""
    return {name: options.SCALAR_FIELD for name, options in {**own, **registry.option_tables()}.items()
            if options.SCALAR_FIELD is not None}
