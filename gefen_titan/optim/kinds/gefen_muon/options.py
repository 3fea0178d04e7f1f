"""GefenMuon's own options, ``[optimizer.muon]``: what every GefenMuon the container builds is built with.

The kind's, not the container's (as ``optim.kinds.gefen.options``): the registry
entry names this table and carries its class (``OptimizerSpec.options``,
``options_type``) and the container gives
each GefenMuon ``kwargs(config)`` as its constructor options. Older recipes' flat
``[optimizer]`` keys (``FLAT_KEYS``) are read into it by the recipe layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from gefen_titan.optim.cpu_step import MODES
from gefen_titan.optim.muon.schedule import DEFAULT_BUCKET_MIB
from gefen_titan.optim.options_table import OptionsTableBase

__all__ = ["MuonOptions"]


@dataclass(kw_only=True, slots=True)
class MuonOptions(OptionsTableBase):
    """``[optimizer.muon]``: what every GefenMuon optimizer of the run is built with."""

    # The flat [optimizer] key of older recipes -> this table's field (deterministic and
    # cpu_step were one key for Gefen and GefenMuon: they set both tables).
    FLAT_KEYS: ClassVar[dict[str, str]] = {"muon_bucket_mib": "bucket_mib", "deterministic": "deterministic",
                                           "cpu_step": "cpu_step"}

    bucket_mib: float = DEFAULT_BUCKET_MIB
    """The bytes (MiB) of dense momentum one bucket of its sharded step may
    put in flight on a rank (what the rank sends, plus the whole matrices it
    orthogonalizes), raised to twice the largest GefenMuon matrix. Two buckets
    are live at a time (the next one's exchange overlaps this one's
    Newton-Schulz); fewer, larger buckets mean fewer exchanges, smaller ones
    less memory (docs/gefen_muon.md)."""

    deterministic: bool = False
    """gefen-x's replica-exact arithmetic on CUDA at some speed cost."""

    cpu_step: Literal["kernel", "gefen-x"] = "kernel"
    """Its momentum update on CPU tensors: gefen-titan's exact kernel
    (``"kernel"``) or gefen-x's own (``"gefen-x"``), as Gefen's
    ``optimizer.gefen.cpu_step``."""

    def __post_init__(self) -> None:
        if not self.bucket_mib > 0:
            raise ValueError(f"optimizer.muon.bucket_mib must be > 0, got {self.bucket_mib!r}")
        if self.cpu_step not in MODES:
            raise ValueError(f"optimizer.muon.cpu_step must be 'kernel' or 'gefen-x', got {self.cpu_step!r}")

    def kwargs(self, config: Any = None) -> dict[str, Any]:
        """The constructor options (the registry entry's ``option_keys``)."""
        return {"deterministic": self.deterministic, "bucket_mib": self.bucket_mib, "cpu_step": self.cpu_step}
