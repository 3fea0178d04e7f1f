"""``[optimizer.blocking]``: how the block periods and codebook of Gefen-family kinds are chosen.

The container's own table (not a kind's): one agreement sets every kind's
periods and picks every kind's checkpoint format. Recipes written before the
table set ``[optimizer] blocking = "agreed"`` (a string where the table now
is: ``SCALAR_FIELD``) and ``[optimizer] max_tensor_parallel_degree = 2``
(``FLAT_KEYS``); the recipe layer reads both into it, on the command line too
(``--optimizer.blocking per_rank``, ``--optimizer.max_tensor_parallel_degree 2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from gefen_titan.optim.options_table import OptionsTableBase

__all__ = ["MODES", "BlockingOptions"]

MODES = ("agreed", "per_rank")


@dataclass(kw_only=True, slots=True)
class BlockingOptions(OptionsTableBase):
    """``[optimizer.blocking]``: how the block periods and codebook of Gefen-family kinds are
    chosen on the first step (``mode``), and the TP degrees a checkpoint must resume at."""

    FLAT_KEYS: ClassVar[dict[str, str]] = {"max_tensor_parallel_degree": "max_tensor_parallel_degree"}
    SCALAR_FIELD: ClassVar[str | None] = "mode"

    mode: Literal["agreed", "per_rank"] = "agreed"
    """``"agreed"`` (default): from global statistics, the same on every rank
    (``gefen_titan.optim.blocking``), so the state is a function of the model
    alone: the same recipe trains the same optimizer at any mesh, and a
    checkpoint (format v3) resumes bit-exactly at any FSDP / TP / HSDP /
    pipeline layout. Costs one small all-gather and one 4096-bin
    all-reduce on step 1; periods are limited to divisors of the row
    length (and of the TP cuts), which can make blocks finer than
    gefen-x would choose (a few hundredths of a byte per parameter).
    ``"per_rank"``: gefen-x's own behaviour, each rank learns from its
    shard (format v1); resumes at another layout requantize, and TP
    layouts cannot be checkpointed. Container-wide: one agreement sets
    every kind's periods, and it picks every kind's checkpoint format.
    (Older recipes: ``[optimizer] blocking = "per_rank"``.)"""

    max_tensor_parallel_degree: int = 1
    """Agreed blocking: the largest tensor-parallel degree a checkpoint of
    this run must resume at. Blocks then never cross the last-dim cut of
    any TP degree that divides it (the live layout's cuts always count).
    A resume at a TP degree not declared here is refused unless the
    periods happen to fit. Container-wide, as ``mode``. (Older recipes:
    ``[optimizer] max_tensor_parallel_degree``.)"""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"optimizer.blocking.mode must be 'agreed' or 'per_rank', got {self.mode!r}")
        if self.max_tensor_parallel_degree < 1:
            raise ValueError(f"optimizer.blocking.max_tensor_parallel_degree must be >= 1, "
                             f"got {self.max_tensor_parallel_degree!r}")
