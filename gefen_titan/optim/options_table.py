"""What an ``[optimizer]`` options table is: ``OptionsTable``, and ``OptionsTableBase``'s defaults.

An options table is a dataclass that the container's Config holds as one
field (``[optimizer.gefen]``, ``[optimizer.muon]``, ``[optimizer.hybrid]``,
the container's own ``[optimizer.blocking]``). A kind's registry entry names
its table and carries its class (``OptimizerSpec.options`` and
``options_type``), and the Config's fields for them are generated from the
registry (``optim.config_tables``). The container and the recipe layer know a
table only through this seam:

* ``kwargs(config)``: the optimizer-wide constructor options the container gives
  every optimizer of the kind (the entry's ``option_keys``), under the
  container's Config (an option may follow the rest of it: Gefen's
  ``second_moment = "auto"`` follows the blocking; None: its defaults);
* ``FLAT_KEYS``: a flat ``[optimizer]`` key of recipes written before the
  table -> the field it sets; the recipe layer lifts them into the table;
* ``SCALAR_FIELD``: the field that a plain value given where the table now is
  sets (``[optimizer] blocking = "per_rank"`` of older recipes: the
  ``blocking`` table's ``mode``), None for none;
* ``check_config(config)``: refuses (ValueError) values of the table that
  the rest of the ``[optimizer]`` config cannot keep (Gefen's options that
  agreed blocking cannot align), called by the Config once it is built.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

__all__ = ["OptionsTable", "OptionsTableBase"]


class OptionsTable(Protocol):
    """An ``[optimizer.<table>]`` dataclass (see the module docstring)."""

    FLAT_KEYS: ClassVar[dict[str, str]]
    SCALAR_FIELD: ClassVar[str | None]

    def kwargs(self, config: Any = None) -> dict[str, Any]: ...

    def check_config(self, config: Any) -> None: ...


class OptionsTableBase:
    """``OptionsTable``'s defaults for a table dataclass to inherit: no flat keys,
    no scalar spelling, no constructor options, nothing to check against the Config."""

    __slots__ = ()

    FLAT_KEYS: ClassVar[dict[str, str]] = {}
    SCALAR_FIELD: ClassVar[str | None] = None

    def kwargs(self, config: Any = None) -> dict[str, Any]:
        return {}

    def check_config(self, config: Any) -> None:
        return None
