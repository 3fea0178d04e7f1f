"""Gefen's own options, ``[optimizer.gefen]``: the constructor options of every Gefen the container builds.

They are the kind's, not the container's: ``GefenOptimizersContainer.Config``
keeps what every optimizer kind shares (the shorthand, the blocking, torchtitan's
keys) and holds one options table per kind, which the kind's registry entry
names (``OptimizerSpec.options``); the container gives each optimizer of the
kind ``kwargs(config)`` as its constructor options, so every group of it agrees.
Recipes written before the split set these as flat ``[optimizer]`` keys
(``FLAT_KEYS``); the recipe layer still reads them into this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from gefen_titan.optim.cpu_step import MODES
from gefen_titan.optim.options_table import OptionsTableBase

__all__ = ["FACTORED_V_2D", "GefenOptions"]

# gefen-x's own factoring is pinned off: it cannot factor a shard (FSDP2-sharded
# 2-D params fall back to the block second moment), so a run's state would
# depend on the world size. ``second_moment = "factored"`` is gefen-titan's
# sharded one (optim.kinds.gefen.factored), the same at every layout.
FACTORED_V_2D = False


@dataclass(kw_only=True, slots=True)
class GefenOptions(OptionsTableBase):
    """``[optimizer.gefen]``: what every Gefen optimizer of the run is built with."""

    # The flat [optimizer] key of older recipes -> this table's field.
    FLAT_KEYS: ClassVar[dict[str, str]] = {k: k for k in (
        "force_1d_period_one", "period_one_substrings", "codebook_refresh_every", "deterministic", "cpu_step")}

    force_1d_period_one: bool = True
    """1-D params (norm weights, biases) keep per-element state. They are
    tiny and set the LR stability ceiling, so on by default."""

    period_one_substrings: list[str] = field(default_factory=list)
    """Name substrings whose params keep per-element state
    (e.g. ``["tok_embeddings", "output"]``); costs 8 B/param on them."""

    codebook_refresh_every: int = 0
    """Relearn the codebook every N steps (0: learn once, step 1)."""

    deterministic: bool = False
    """Replica-exact arithmetic on CUDA at some speed cost."""

    second_moment: Literal["auto", "block", "factored"] = "auto"
    """``"factored"``: for every parameter of two dims or more, fp32 EMAs of
    grad²'s row and column means, rebuilt per element as ``outer(R, C) / mean(R)``
    (gefen-x's ``factored_v_2d``, its AdamW-parity mode, done here on shards
    with exact cross-rank sums: the state is the same bits at every layout;
    ``optim.kinds.gefen.factored``). Needs agreed blocking. ``"block"``: one
    ``vmean`` per block of the momentum (gefen-x's legacy path, 4 B per block;
    what gefen-titan ran before format v4). ``"auto"`` (the default):
    ``"factored"`` under agreed blocking, ``"block"`` under per-rank blocking,
    whose format (v1) stores only the block moment; the container's config
    builds each optimizer with the one its blocking implies
    (``resolved_second_moment``). The default is factored because it trained
    better than block at every learning rate of the quality benchmark and
    closed most of block's gap to AdamW (docs/recipes.md, "The second
    moment"). A resume may switch: the second moment then restarts from zero
    with its own step count (docs/recipes.md)."""

    cpu_step: Literal["kernel", "gefen-x"] = "kernel"
    """On CPU tensors (CPU hosts, CPU offload): ``"kernel"`` runs gefen-titan's
    exact CPU kernel (``optim.cpu_step``: the same bits as gefen-x's own step,
    at a few times fused AdamW's cost instead of about 100x), or gefen-x's own
    path where the kernel cannot run here (no C++ compiler, a CPU torch runs
    without AVX2: one warning says why); ``"gefen-x"`` always runs gefen-x's
    own. The log names each optimizer's."""

    def __post_init__(self) -> None:
        if self.codebook_refresh_every < 0:
            raise ValueError("optimizer.gefen.codebook_refresh_every must be >= 0")
        if self.second_moment not in ("auto", "block", "factored"):
            raise ValueError(
                f"optimizer.gefen.second_moment must be 'auto', 'block' or 'factored', got {self.second_moment!r}")
        if self.cpu_step not in MODES:
            raise ValueError(f"optimizer.gefen.cpu_step must be 'kernel' or 'gefen-x', got {self.cpu_step!r}")

    def check_config(self, config: Any) -> None:
        """Refuse the options that the blocking (``optimizer.blocking.mode``, the container's) cannot keep
        (``second_moment = "auto"`` is not one: ``resolved_second_moment`` follows the blocking)."""
        if config.blocking.mode != "agreed":
            if self.second_moment == "factored":
                raise ValueError(
                    "optimizer.gefen.second_moment = \"factored\" needs agreed blocking (its row and column "
                    "sums are agreed across ranks, and only the agreed format stores them); set "
                    "optimizer.blocking.mode = \"agreed\", or second_moment = \"block\"")
            return
        if self.codebook_refresh_every > 0:
            raise ValueError(
                "optimizer.gefen.codebook_refresh_every > 0 relearns the codebook on each rank from its own "
                "gradient shard, which breaks agreed blocking; set it to 0, or set "
                "optimizer.blocking.mode = \"per_rank\"")
        if not self.force_1d_period_one:
            raise ValueError(
                "optimizer.gefen.force_1d_period_one = false lets gefen-x block 1-D parameters across FSDP "
                "shard cuts, which agreed blocking cannot align; keep it true, or set "
                "optimizer.blocking.mode = \"per_rank\"")

    def kwargs(self, config: Any = None) -> dict[str, Any]:
        """The constructor options (the registry entry's ``option_keys``) under the container's ``config``."""
        return {"factored_v_2d": FACTORED_V_2D, "force_1d_period_one": self.force_1d_period_one,
                "period_one_substrings": tuple(self.period_one_substrings),
                "codebook_refresh_every": self.codebook_refresh_every, "deterministic": self.deterministic,
                "second_moment": self.resolved_second_moment(config), "cpu_step": self.cpu_step}

    def resolved_second_moment(self, config: Any = None) -> str:
        """``"block"`` or ``"factored"``: ``"auto"`` by the container ``config``'s blocking (None: agreed, the
        blocking's default; options read on their own, e.g. by the scale plan). Not written back into the
        table: a recipe's config is built in steps (its blocking may be set after this table), so the table
        keeps "auto" and each reader resolves it against the config it is built under."""
        if self.second_moment != "auto":
            return self.second_moment
        return "factored" if config is None or config.blocking.mode == "agreed" else "block"
