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
    "GEFEN_LIVE_BLOCK_FLOATS", "GEFEN_CONSTRUCTOR",
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
        "not supported yet (issue 48 will add it sharded): gefen-x falls back to the block second moment (vmean) "
        "for DTensor parameters (FSDP2 shards), and its factored state (v_row, v_col) is not shard-addressable, so "
        "it could neither agree across layouts nor reshard; gefen-titan builds every Gefen with factored_v_2d = "
        "false (docs/gefen_internals.md, 'How each parameter is routed')"),
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
    """One parameter's Gefen state on this rank (tensors are the live ones)."""

    period: int
    step: int
    vmean_step: int
    codes: torch.Tensor  # uint8 [blocks, period]
    magnitude: torch.Tensor  # fp32 [blocks, 1]
    vmean: torch.Tensor  # fp32 [blocks, 1]


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
    if "v_row" in st or "factored_step" in st:
        raise ValueError("factored second moment (factored_v_2d) state is not supported by gefen_titan")
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
    expect = {"codes": (torch.uint8, (blocks, state.period)), "magnitude": (torch.float32, (blocks, 1)),
              "vmean": (torch.float32, (blocks, 1))}
    for what, (dtype, shape) in expect.items():
        t = getattr(state, what)
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{what}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    st = optim.state[p]
    st["automatic_period"] = int(state.period)
    st["step"] = int(state.step)
    st["vmean_step"] = int(state.vmean_step)
    st["m_codebook"] = state.codes
    st["m_magnitude"] = state.magnitude
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
