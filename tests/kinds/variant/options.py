"""``[optimizer.variant]``: what every Variant optimizer of the run is built with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gefen_titan.optim.options_table import OptionsTableBase

__all__ = ["VariantOptions"]


@dataclass(kw_only=True, slots=True)
class VariantOptions(OptionsTableBase):
    """``[optimizer.variant]``: Variant's options."""

    deterministic: bool = False
    """gefen-x's replica-exact arithmetic (as ``optimizer.gefen.deterministic``)."""

    def kwargs(self, config: Any = None) -> dict[str, Any]:
        """The constructor options (the entry's ``option_keys``)."""
        return {"deterministic": self.deterministic}
