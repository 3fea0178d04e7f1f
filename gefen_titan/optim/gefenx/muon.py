"""GefenMuon's private state in gefen-x 0.5.0 and the pieces of its step the sharded step drives.

Part of ``gefen_titan.optim.gefenx`` (the package doc says why it exists):
per parameter ``automatic_period``, ``step``, ``m_codebook``,
``m_magnitude``, NorMuon's ``normuon_v`` and ``normuon_step`` (no
``vmean``); the momentum update, Newton-Schulz, NorMuon and the apply that
``gefen_titan.optim.muon`` runs on shards; GefenMuonHybrid's defaults and
Newton-Schulz schedules (read, never built); NorMuon's bytes per row
(``NORMUON_ROW_BYTES``, which the kind's cost rule counts:
``optim.kinds.gefen_muon.cost``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from gefen import Gefen, GefenMuon, GefenMuonHybrid
from gefen.gefen_muon import NS_SCHEDULES, _adjust_lr, _zeropower_via_newtonschulz
from torch.distributed.tensor import DTensor
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
    "MUON_CONSTRUCTOR", "MUON_GROUP_KEYS", "MUON_REFUSED", "MUON_UPDATE_DTYPE", "MuonState", "ShardedGefenMuon",
    "ShardedStep",
    "new_gefen_muon", "muon_sharded_step", "is_gefen_muon", "muon_defaults", "muon_refused", "muon_deterministic",
    "muon_read", "muon_write", "muon_rows", "muon_set_rows", "muon_momentum", "muon_orthogonalize", "muon_normuon",
    "muon_apply", "muon_restore_group", "hybrid_defaults", "ns_schedule_names",
    "ns_schedule_coefficients", "NORMUON_ROW_BYTES",
]

# ------------------------------------------------------------------ GefenMuon
# GefenMuon (Muon whose momentum is Gefen-quantized) keeps, per 2-D parameter,
# ``automatic_period``, ``step``, ``m_codebook`` uint8 [blocks, period] and
# ``m_magnitude`` fp32 [blocks, 1] (blocks run along rows: a period that
# divides the row length keeps every block inside one row), and with NorMuon
# ``normuon_v`` fp32 [rows, 1] and ``normuon_step``; per optimizer the same
# codebook and global step attributes as Gefen. gefen_titan never runs gefen-x's
# ``step()`` (which gathers every full gradient on every rank): the optimizers
# it builds are ``ShardedGefenMuon``, whose ``step()`` is the sharded step
# (``gefen_titan.optim.muon``), which calls the pieces below in gefen-x's order.

# The group keys gefen_titan supports, checkpoints and restores on load (its records' ``MUON_HYPER``).
MUON_GROUP_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn",
                   "normuon", "normuon_beta2", "normuon_eps")

# Every keyword of GefenMuon's constructor: applied in [optimizer.muon], routed, or refused (gefenx.constructor).
# Refused: each makes the arithmetic depend on the layout or the machine, which the sharded step and the
# checkpoint's bit-exact resharding cannot keep.
MUON_CONSTRUCTOR = Constructor(GefenMuon, {
    # Its group keys, which the records carry and a load restores; lr and weight_decay may come from the shorthand.
    **{k: Routed(shorthand_place(k) if k in ("lr", "weight_decay")
                 else f"a GefenMuon param group's optimizer_kwargs.{k}") for k in MUON_GROUP_KEYS},
    "fused": Routed(IMPLEMENTATION),
    "deterministic": Applied("deterministic"),
    "sharded_mode": Refused("gefen-titan shards GefenMuon itself (momentum on the parameter's shards, Newton-Schulz "
                            "on one owner rank); gefen-x's modes replicate the momentum or place it by world size"),
    "fp8_ns": Refused("fp8 Newton-Schulz runs only on sm_89+ GPUs above a matrix size, so results depend on the "
                      "machine"),
    "fp8_ns_compile": Refused("it only configures fp8 Newton-Schulz, which is refused"),
    "batched_ns": Refused("batched Newton-Schulz changes the GEMM reduction order with the matrices a rank batches"),
    "batched_ns_workspace_bytes": Refused("it only configures batched Newton-Schulz, which is refused"),
    "stochastic_round": Refused(STOCHASTIC_ROUND),
    "cautious": Refused("cautious masking needs the full gradient where Newton-Schulz runs, which is not gathered"),
    "capturable": Refused(CAPTURABLE),
    "ns_schedule": Refused("set ns_coefficients to the schedule's list of [a, b, c] instead (the record keeps those)"),
    "verbose": Refused(VERBOSE),
})

# GefenMuon options refused (as group keys and as constructor options), each with its reason.
MUON_REFUSED = {k: v.reason for k, v in MUON_CONSTRUCTOR.options.items() if isinstance(v, Refused)}

# The dtype of gefen-x's Newton-Schulz output (bf16 GEMMs), the update the owner sends.
MUON_UPDATE_DTYPE = torch.bfloat16

_MUON_OWNED = ("automatic_period", "step", "m_codebook", "m_magnitude", "normuon_v", "normuon_step")


@dataclass
class MuonState:
    """One GefenMuon parameter's state on this rank (tensors are the live ones)."""

    period: int
    step: int
    codes: torch.Tensor  # uint8 [blocks, period]
    magnitude: torch.Tensor  # fp32 [blocks, 1]
    rows: torch.Tensor | None  # NorMuon fp32 [local rows, 1]; None before NorMuon's first step
    rows_step: int


class _Registration(Gefen):
    """Sits between GefenMuon and Gefen in ``ShardedGefenMuon``'s MRO: it puts grouped
    experts' weights back in place of their stand-ins before Gefen registers a group."""

    def add_param_group(self, param_group):
        stand_ins = getattr(self, "_grouped_stand_ins", {})
        if stand_ins:
            param_group = dict(param_group, params=[
                (item[0], stand_ins.get(id(item[1]), item[1])) if isinstance(item, tuple)
                else stand_ins.get(id(item), item) for item in param_group["params"]])
        return super().add_param_group(param_group)


class ShardedStep(Protocol):
    """What a ``ShardedGefenMuon`` runs as its ``step()``: ``gefen_titan.optim.muon.ShardedMuonStep``,
    handed to the constructor by the registry's factory (this package sits below ``optim.muon``,
    which drives the pieces here, so the step comes in as a constructor argument)."""

    def __call__(self) -> None: ...


class ShardedGefenMuon(GefenMuon, _Registration):
    """gefen-x's GefenMuon whose ``step()`` is gefen-titan's sharded step.

    A subclass, not a container-level driver, so that every caller of
    ``step()`` (torchtitan's container loop, an LR scheduler's step
    tracking, the optimizer's own hooks) gets the sharded step and none can
    reach gefen-x's, which would gather full gradients and replace the
    sharded state.

    It also takes grouped experts' weights ``(E, out, in)`` (torchtitan's
    MoE), which the sharded step runs as E matrices (``muon.matrices``).
    gefen-x's GefenMuon refuses any parameter that is not 2-D because its own
    ``step()`` is per matrix; that step never runs here, and everything
    gefen-titan calls of it (the momentum, per block; Newton-Schulz and
    NorMuon, on each expert's 2-D slice; the apply, ``muon_apply``) is
    dimension-free or given a matrix. So GefenMuon validates and completes
    a group's keys with a 2-D stand-in for each 3-D weight
    (``add_param_group``), and ``_Registration``, next in the MRO before
    Gefen, registers the weight itself.
    """

    def __init__(self, params: Any, *, sharded_step: Callable[[Optimizer], ShardedStep] | None = None,
                 **options: Any) -> None:
        super().__init__(params, **options)
        # None: an optimizer whose pieces a caller drives itself (tests, benchmarks); it cannot step.
        self._sharded_step = sharded_step(self) if sharded_step is not None else None

    def add_param_group(self, param_group):
        if not isinstance(param_group, dict) or "params" not in param_group:
            return super().add_param_group(param_group)
        items = [param_group["params"]] if isinstance(param_group["params"], torch.Tensor) \
            else list(param_group["params"])
        stand_ins, shown = {}, []
        for item in items:
            name, p = item if isinstance(item, tuple) else (None, item)
            if isinstance(p, torch.Tensor) and p.ndim == 3:
                stand_in = torch.empty(p.shape[0] * p.shape[1], p.shape[2], device="meta", dtype=p.dtype)
                stand_ins[id(stand_in)] = p
                p = stand_in
            shown.append((name, p) if isinstance(item, tuple) else p)
        self._grouped_stand_ins = stand_ins
        try:
            return super().add_param_group(dict(param_group, params=shown))
        finally:
            self._grouped_stand_ins = {}

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("GefenMuon under gefen-titan takes no closure")
        if self._sharded_step is None:
            raise RuntimeError("this GefenMuon has no sharded step: build it through gefen_titan.optim.registry")
        self._sharded_step()


def new_gefen_muon(param_groups: list[dict[str, Any]], sharded_step: Callable[[Optimizer], ShardedStep] | None = None,
                   **options: Any) -> Optimizer:
    """A ``ShardedGefenMuon(param_groups, **options)`` that runs ``sharded_step(optimizer)`` as its step:
    the one place gefen-titan constructs GefenMuon."""
    return ShardedGefenMuon(param_groups, sharded_step=sharded_step, **options)


def muon_sharded_step(optim: Optimizer) -> Any:
    """The step object a ``ShardedGefenMuon`` runs (its constructor's)."""
    return optim._sharded_step


NORMUON_ROW_BYTES = 4  # NorMuon's fp32 second moment per row (normuon_v)


def is_gefen_muon(optim: Optimizer) -> bool:
    """gefen-titan's GefenMuon exactly (gefen-x's own, stepped by itself, and
    GefenMuonHybrid, a container of its own, are not supported)."""
    return type(optim) is ShardedGefenMuon


def muon_defaults() -> dict[str, Any]:
    """gefen-x's constructor default of every ``MUON_GROUP_KEYS`` key."""
    params = inspect.signature(GefenMuon.__init__).parameters
    return {k: params[k].default for k in MUON_GROUP_KEYS}


def muon_refused(optim: Optimizer) -> list[str]:
    """The ``MUON_REFUSED`` settings a built GefenMuon has switched on."""
    on = []
    if optim.capturable:
        on.append("capturable")
    if optim._stochastic_round:
        on.append("stochastic_round")
    for group in optim.param_groups:
        on += [k for k in ("fp8_ns", "batched_ns", "cautious") if group.get(k)]
        if group.get("sharded_mode", "exact") != "exact":
            on.append("sharded_mode")
        if group.get("ns_schedule") is not None:
            on.append("ns_schedule")
    return sorted(set(on))


def muon_deterministic(optim: Optimizer) -> bool:
    return bool(optim._deterministic)


def muon_read(optim: Optimizer, p: torch.Tensor) -> MuonState | None:
    """The parameter's state, or None before its first step."""
    st = optim.state.get(p, {})
    if "m_codebook" not in st:
        return None
    return MuonState(period=int(st["automatic_period"]), step=int(st["step"]), codes=st["m_codebook"],
                     magnitude=st["m_magnitude"], rows=st.get("normuon_v"), rows_step=int(st.get("normuon_step", 0)))


def muon_write(optim: Optimizer, p: torch.Tensor, state: MuonState | None) -> None:
    """Replace the parameter's state (None: never stepped).

    GefenMuon updates the codes and magnitudes in place as ``[blocks,
    period]`` / ``[blocks, 1]`` and NorMuon's rows as ``[rows, 1]``, so they
    must be contiguous tensors of exactly those shapes and dtypes.
    """
    st = optim.state[p]
    if state is not None:
        blocks = state.codes.shape[0]
        expect = [("codes", state.codes, torch.uint8, (blocks, state.period)),
                  ("magnitude", state.magnitude, torch.float32, (blocks, 1))]
        if state.rows is not None:
            expect.append(("rows", state.rows, torch.float32, (state.rows.shape[0], 1)))
        for what, t, dtype, shape in expect:
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"{what}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    for key in _MUON_OWNED:
        st.pop(key, None)
    if state is None:
        return
    st["automatic_period"] = int(state.period)
    st["step"] = int(state.step)
    st["m_codebook"] = state.codes
    st["m_magnitude"] = state.magnitude
    if state.rows is not None:
        st["normuon_v"] = state.rows
        st["normuon_step"] = int(state.rows_step)


def muon_rows(optim: Optimizer, p: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """NorMuon's per-row state ``[local rows, 1]`` and its counter (None, 0 before its first step)."""
    st = optim.state.get(p, {})
    return st.get("normuon_v"), int(st.get("normuon_step", 0))


def muon_set_rows(optim: Optimizer, p: torch.Tensor, rows: torch.Tensor, rows_step: int) -> None:
    st = optim.state[p]
    st["normuon_v"] = rows
    st["normuon_step"] = int(rows_step)


def muon_momentum(optim: Optimizer, fqn: str, p: torch.Tensor, group: dict, grad: torch.Tensor) -> torch.Tensor:
    """Advance the quantized momentum of this rank's shard by ``grad`` (its local gradient).

    gefen-x's ``_prepare_muon_momentum``: dequantize, lerp towards the
    gradient by ``1 - momentum``, requantize per block with the optimizer's
    codebook, count the step; returns the dense (Nesterov-blended) momentum
    of the shard, shaped like ``grad``. Every operation is per element or per
    block, so on a shard of whole blocks it equals the full matrix's rows;
    the period must be pre-set (``set_period``) and divide the shard.
    """
    _, dense = optim._prepare_muon_momentum(group, fqn, p, grad, grad.numel())
    return dense


def muon_orthogonalize(group: dict, momentum: torch.Tensor) -> torch.Tensor:
    """gefen-x's bf16 Newton-Schulz of a whole matrix with the group's coefficients."""
    return _zeropower_via_newtonschulz(momentum, group["ns_coefficients"], group["ns_steps"], group["eps"])


def muon_normuon(optim: Optimizer, group: dict, ortho: torch.Tensor, rows: torch.Tensor | None,
                 rows_step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """NorMuon on a whole matrix: (normalized update, updated rows [rows, 1], counter).

    ``rows`` (the whole matrix's, or None on NorMuon's first step) is updated in place.
    """
    st: dict[str, Any] = {} if rows is None else {"normuon_v": rows, "normuon_step": rows_step}
    out = optim._normuon_normalize(st, ortho, group["normuon_beta2"], group["normuon_eps"])
    return out, st["normuon_v"], int(st["normuon_step"])


def muon_apply(optim: Optimizer, group: dict, p: torch.Tensor, update: torch.Tensor) -> None:
    """Decoupled weight decay, then ``p -= adjusted_lr * update`` on this rank's shard.

    ``update`` is the shard's slice of the orthogonalized update; the lr
    adjustment comes from the global shape of the matrix (gefen-x's
    ``_apply_muon_update`` with a pre-sliced update). For a grouped experts'
    weight ``(E, out, in)`` the matrix is one expert's ``(out, in)``: gefen-x
    would take ``(E, out)``, so its non-capturable path (the only one
    gefen-titan runs: ``capturable`` is refused) is written out here with
    the expert's shape, the same operations in the same order
    (``tests/unit/test_gefen_muon.py`` pins it: a grouped weight steps as gefen-x's
    GefenMuon over one 2-D parameter per expert, bit for bit).
    """
    if p.dim() != 3:
        optim._apply_muon_update(group, p, update, isinstance(p, DTensor), True)
        return
    adjusted_lr = _adjust_lr(optim._lr_scalar(group), group["adjust_lr_fn"], p.shape[1:])
    shard = p.to_local() if isinstance(p, DTensor) else p
    if group["weight_decay"] > 0.0:
        shard.mul_(1 - group["lr"] * group["weight_decay"])
    if shard.numel() > 0:
        shard.add_(update, alpha=-adjusted_lr)


def muon_restore_group(group: dict, values: dict[str, Any]) -> None:
    """Set a GefenMuon group's ``MUON_GROUP_KEYS`` (a checkpoint's), keeping
    the ``beta1``/``beta2`` mirror of ``momentum`` that gefen-x's group keeps."""
    group.update({k: values[k] for k in MUON_GROUP_KEYS})
    group["beta1"], group["beta2"] = values["momentum"], 0.0


# GefenMuonHybrid is never built (optim.hybrid expands it into groups): its defaults and NS schedules are read.
def hybrid_defaults() -> dict[str, Any]:
    """gefen-x's ``GefenMuonHybrid.__init__`` keyword defaults (``lr`` has none: absent)."""
    params = inspect.signature(GefenMuonHybrid.__init__).parameters
    return {k: p.default for k, p in params.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty}


def ns_schedule_names() -> tuple[str, ...]:
    """The named Newton-Schulz schedules gefen-x's ``ns_schedule`` takes ("standard", "tuned3", ...)."""
    return tuple(NS_SCHEDULES)


def ns_schedule_coefficients(name: str) -> list[list[float]] | None:
    """A named schedule as GefenMuon's ``ns_coefficients`` (one ``[a, b, c]`` per iteration), None for
    ``"standard"`` (the fixed quintic ``ns_coefficients`` repeated ``ns_steps`` times)."""
    if name not in NS_SCHEDULES:
        raise ValueError(f"unknown Newton-Schulz schedule {name!r} (gefen-x has {', '.join(NS_SCHEDULES)})")
    schedule = NS_SCHEDULES[name]
    return None if schedule is None else [[float(x) for x in abc] for abc in schedule]
