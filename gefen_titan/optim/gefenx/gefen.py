"""Gefen's own private state in gefen-x 0.5.0: its ``gefen_*`` accessors.

Part of ``gefen_titan.optim.gefenx`` (the package doc says why it exists):
per parameter ``step``, ``vmean_step``, ``m_codebook`` (uint8
``[blocks, period]``), ``m_magnitude`` and ``vmean`` (fp32 ``[blocks, 1]``)
in ``optim.state[p]`` (``GefenParamState``); its constructor's keywords, each
classified (``GEFEN_CONSTRUCTOR``); how many fp32 a block keeps live
(``GEFEN_LIVE_BLOCK_FLOATS``, which the kind's cost rule counts:
``optim.kinds.gefen.cost``). What every gefen-x optimizer keeps alike (the
period, the codebook, the global step, the names) is ``family``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from gefen import Gefen
from torch.optim import Optimizer

from gefen_titan.optim.gefenx.constructor import (
    CAPTURABLE,
    IMPLEMENTATION,
    STOCHASTIC_ROUND,
    VERBOSE,
    Applied,
    Constructor,
    Refused,
    Routed,
    shorthand_place,
)

__all__ = [
    "GefenParamState", "is_gefen", "new_gefen", "gefen_read", "gefen_write", "gefen_clear", "gefen_has_state",
    "gefen_count_empty_shard_step", "gefen_empty_shard_counters", "gefen_set_empty_shard_counters",
    "GEFEN_LIVE_BLOCK_FLOATS", "GEFEN_CONSTRUCTOR", "GefenFactoredState", "gefen_factored_state",
    "gefen_factored_init", "gefen_factored_advance", "gefen_momentum_update", "gefen_empty_shard_factors",
    "gefen_set_empty_shard_factors",
]

# Every keyword of Gefen's constructor: applied in [optimizer.gefen], routed, or refused (gefenx.constructor).
GEFEN_CONSTRUCTOR = Constructor(Gefen, {
    **{k: Routed(shorthand_place(k)) for k in ("lr", "betas", "eps", "weight_decay")},
    "fused": Routed(IMPLEMENTATION),
    "force_1d_period_one": Applied("force_1d_period_one"),
    "period_one_substrings": Applied("period_one_substrings"),
    "codebook_refresh_every": Applied("codebook_refresh_every"),
    "deterministic": Applied("deterministic"),
    "force_2d_period_one": Refused(
        "gefen-titan has no switch for every 2-D parameter: name the 2-D parameters that should keep per-element "
        "state in optimizer.gefen.period_one_substrings"),
    # gefen-titan builds every Gefen with factored_v_2d=False (optim.kinds.gefen.options.FACTORED_V_2D).
    "factored_v_2d": Refused(
        "gefen-x's own factored second moment cannot factor a shard (it falls back to vmean for DTensor "
        "parameters, so the state would depend on the layout); gefen-titan's, sharded and the same at every "
        "layout, is optimizer.gefen.second_moment = \"factored\" (docs/recipes.md, 'The second moment')"),
    "stochastic_round": Refused(STOCHASTIC_ROUND),
    "capturable": Refused(CAPTURABLE),
    "verbose": Refused(VERBOSE),
})

# Keys of a stepped parameter's state that gefen_titan owns on load (everything
# but the name Gefen set at construction and its checkpoint-transport
# placeholders, which live state must keep; see docs/gefen_internals.md e).
_OWNED = ("automatic_period", "step", "vmean_step", "m_codebook", "m_magnitude", "vmean",
          "stepsize", "_h_buf", "v_row", "v_col", "factored_step")


@dataclass
class GefenParamState:
    """One parameter's Gefen state on this rank (tensors are the live ones).

    Its second moment is either the block ``vmean`` or, for a matrix under
    ``[optimizer.gefen] second_moment = "factored"`` (``optim.kinds.gefen.factored``),
    the row and column EMAs ``v_row`` / ``v_col`` of this rank's rows and
    columns (gefen-x's key names, kept in the same state dict); ``vmean_step``
    counts the steps of whichever it is (gefen-x: ``vmean_step`` or ``factored_step``).
    """

    period: int
    step: int
    vmean_step: int
    codes: torch.Tensor  # uint8 [blocks, period]
    magnitude: torch.Tensor  # fp32 [blocks, 1]
    vmean: torch.Tensor | None  # fp32 [blocks, 1]; None: factored
    v_row: torch.Tensor | None = None  # fp32, the local shard's shape[:-1]
    v_col: torch.Tensor | None = None  # fp32, its shape[:-2] + shape[-1:]

    @property
    def factored(self) -> bool:
        return self.v_row is not None


def new_gefen(param_groups: list[dict[str, Any]], **options: Any) -> Optimizer:
    """``gefen.Gefen(param_groups, **options)``: the one place gefen-titan constructs it."""
    return Gefen(param_groups, **options)


def is_gefen(optim: Optimizer) -> bool:
    """Plain Gefen, exactly: its subclasses (gefen-x's GefenMuon, GefenMuonHybrid)
    keep other state, which nothing here reads or writes."""
    return type(optim) is Gefen


def gefen_has_state(optim: Optimizer, p: torch.Tensor) -> bool:
    return "m_codebook" in optim.state.get(p, {})


def gefen_read(optim: Optimizer, p: torch.Tensor) -> GefenParamState | None:
    """The parameter's quantized state, or None before its first step."""
    st = optim.state.get(p, {})
    if "m_codebook" not in st:
        return None
    if "v_row" in st:
        return GefenParamState(
            period=int(st["automatic_period"]), step=int(st["step"]), vmean_step=int(st["factored_step"]),
            codes=st["m_codebook"], magnitude=st["m_magnitude"], vmean=None, v_row=st["v_row"], v_col=st["v_col"])
    return GefenParamState(
        period=int(st["automatic_period"]),
        step=int(st["step"]),
        vmean_step=int(st.get("vmean_step", st["step"])),
        codes=st["m_codebook"],
        magnitude=st["m_magnitude"],
        vmean=st["vmean"],
    )


def gefen_clear(optim: Optimizer, p: torch.Tensor) -> None:
    """Back to a never-stepped parameter (the name Gefen gave it stays)."""
    st = optim.state[p]
    for key in _OWNED:
        st.pop(key, None)


def gefen_write(optim: Optimizer, p: torch.Tensor, state: GefenParamState | None) -> None:
    """Replace the parameter's state (None: never stepped).

    Gefen reads ``m_codebook`` as ``[blocks, period]`` and the per-block
    tensors as ``[blocks, 1]`` and updates all three in place, so they must be
    contiguous tensors of exactly those shapes and dtypes.
    """
    gefen_clear(optim, p)
    if state is None:
        return
    blocks = state.codes.shape[0]
    expect = {"codes": (torch.uint8, (blocks, state.period)), "magnitude": (torch.float32, (blocks, 1))}
    if state.factored:
        expect.update(v_row=(torch.float32, tuple(state.v_row.shape)), v_col=(torch.float32, tuple(state.v_col.shape)))
    else:
        expect["vmean"] = (torch.float32, (blocks, 1))
    for what, (dtype, shape) in expect.items():
        t = getattr(state, what)
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{what}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    st = optim.state[p]
    st["automatic_period"] = int(state.period)
    st["step"] = int(state.step)
    st["m_codebook"] = state.codes
    st["m_magnitude"] = state.magnitude
    if state.factored:
        st["factored_step"] = int(state.vmean_step)
        st["v_row"], st["v_col"] = state.v_row, state.v_col
    else:
        st["vmean_step"] = int(state.vmean_step)
        st["vmean"] = state.vmean


def gefen_count_empty_shard_step(optim: Optimizer, p: torch.Tensor) -> None:
    """Advance the counters of a parameter whose local shard is empty.

    Gefen returns before touching the state of an empty local shard (an
    uneven FSDP split), so its ``step``/``vmean_step`` would stay behind the
    other ranks'. Agreed blocking keeps them equal on every rank, so a
    checkpoint's counters do not depend on which rank DCP keeps them from.
    Gefen never reads them for an empty shard.
    """
    step, vstep = gefen_empty_shard_counters(optim, p)
    gefen_set_empty_shard_counters(optim, p, step + 1, vstep + 1)


def gefen_empty_shard_counters(optim: Optimizer, p: torch.Tensor) -> tuple[int, int]:
    st = optim.state.get(p, {})
    return int(st.get("step", 0)), int(st.get("vmean_step", 0))


def gefen_set_empty_shard_counters(optim: Optimizer, p: torch.Tensor, step: int, vmean_step: int) -> None:
    st = optim.state[p]
    st["step"] = int(step)
    st["vmean_step"] = int(vmean_step)


# fp32 per block in live state: magnitude and vmean (checkpointed), and
# gefen-x 0.5.0's per-step scratch ``stepsize`` and ``_h_buf``, which it keeps
# in the state between steps (docs/gefen_internals.md; not checkpointed).
GEFEN_LIVE_BLOCK_FLOATS = 4


# ---------------------------------------------------------------- the factored second moment's step
# ``optim.kinds.gefen.factored`` takes a matrix's whole step itself (gefen-x cannot
# factor a shard); these are the pieces of gefen-x's state and arithmetic it uses,
# under gefen-x's own key names (``_step_automatic_factored``, L2784).
@dataclass
class GefenFactoredState:
    """A factored parameter's live second moment and counters on this rank."""

    step: int
    factored_step: int
    v_row: torch.Tensor  # fp32, the local shard's shape[:-1]
    v_col: torch.Tensor  # fp32, its shape[:-2] + shape[-1:]


def gefen_factored_state(optim: Optimizer, p: torch.Tensor) -> GefenFactoredState | None:
    """The live factored state, None before the parameter's first factored step."""
    st = optim.state.get(p, {})
    if "v_row" not in st or "m_codebook" not in st:
        return None
    return GefenFactoredState(int(st["step"]), int(st["factored_step"]), st["v_row"], st["v_col"])


def gefen_factored_init(optim: Optimizer, p: torch.Tensor, grad_view: torch.Tensor, rows: tuple[int, ...],
                        cols: tuple[int, ...]) -> None:
    """Zero state for a factored parameter whose period is set (agreed blocking set it): gefen-x's own
    momentum initialisation (``_init_gefen_state``), zero row and column EMAs, both counters 0.
    A block ``vmean`` (a resume of a block-moment checkpoint) is dropped with its counter."""
    st = optim.state[p]
    if "m_codebook" not in st:
        optim._init_gefen_state(st, grad_view)
        st["step"] = 0
    for key in ("vmean", "vmean_step", "stepsize", "_h_buf"):
        st.pop(key, None)
    st["v_row"] = torch.zeros(rows, dtype=torch.float32, device=grad_view.device)
    st["v_col"] = torch.zeros(cols, dtype=torch.float32, device=grad_view.device)
    st["factored_step"] = 0


def gefen_empty_shard_factors(optim: Optimizer, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(v_row, v_col) that a rank whose shard of a factored parameter is empty keeps, None if none.

    Such a rank holds no element, but one of its factors need not be empty (no rows of a matrix, all its
    columns): it keeps them, updated with the others (the values are the same on every rank that holds
    those columns), so that a save of a replicated ``vcol`` is right whichever rank's copy DCP keeps.
    Without codes, Gefen's own accessors still see no state (``gefen_read`` is None)."""
    st = optim.state.get(p, {})
    if "m_codebook" in st or "v_row" not in st:
        return None
    return st["v_row"], st["v_col"]


def gefen_set_empty_shard_factors(optim: Optimizer, p: torch.Tensor, v_row: torch.Tensor,
                                  v_col: torch.Tensor) -> None:
    st = optim.state[p]
    st["v_row"], st["v_col"] = v_row, v_col


def gefen_factored_advance(optim: Optimizer, p: torch.Tensor) -> tuple[int, int]:
    """Count one step of a factored parameter: (step, factored_step) after it, as gefen-x counts them."""
    st = optim.state[p]
    st["step"] = int(st["step"]) + 1
    st["factored_step"] = int(st["factored_step"]) + 1
    return st["step"], st["factored_step"]


def gefen_momentum_update(optim: Optimizer, p: torch.Tensor, grad_view: torch.Tensor, beta1: float) -> torch.Tensor:
    """gefen-x's quantized momentum step on ``grad_view`` ([blocks, period]): dequantize, lerp, per-block
    magnitude, requantize, in place; returns the requantized momentum (fp32 [blocks, period]). Per block,
    the same arithmetic as its block-moment step (``_automatic_momentum_update_merged``, L3438)."""
    return optim._automatic_momentum_update_merged(optim.state[p], grad_view, beta1)
