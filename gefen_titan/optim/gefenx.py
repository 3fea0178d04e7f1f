"""The one place that reads and writes gefen-x's private optimizer state,
and the one module that imports gefen-x at all (``lint-imports`` checks it).

gefen-x 0.5.0 keeps what a checkpoint needs outside any public API: per
parameter ``automatic_period``, ``step``, ``vmean_step``, ``m_codebook``
(uint8 ``[blocks, period]``), ``m_magnitude`` and ``vmean`` (fp32
``[blocks, 1]``) in ``optim.state[p]``, and per optimizer ``_gefen_codebook``
(fp32 ``[256]``), its per-device caches and ``_gefen_global_step`` as
attributes. Every other module of gefen_titan (the registry's factory, the
agreement hook, the checkpoint adapters, the validation hook) goes through
the functions here, so a change of gefen-x's internals is fixed in one file.
``is_gefen`` is exact: gefen-x's subclasses keep other state. GefenMuon's
(``automatic_period``, ``step``, ``m_codebook``, ``m_magnitude``, NorMuon's
``normuon_v`` [rows, 1] and ``normuon_step``; no ``vmean``) and the pieces of
its step that ``gefen_titan.optim.muon`` drives on shards (the momentum
update, Newton-Schulz, NorMuon, the apply) are the ``muon_*`` functions of
the last section.
``tests/unit/test_contract_gefen.py`` pins, against the real gefen-x, every fact
this module relies on (it reads the internals raw on purpose: it is the
specification of this module). ``docs/gefen_internals.md`` explains them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from gefen import Gefen, GefenMuon, GefenMuonHybrid, partitioning
from gefen.gefen_muon import NS_SCHEDULES, _zeropower_via_newtonschulz
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from gefen_titan.checkpoint import schema
from gefen_titan.checkpoint.schema_muon import MUON_HYPER

__all__ = [
    "K", "ParamState", "is_gefen", "is_gefen_family", "new_gefen", "named_params", "options", "read", "write", "clear",
    "has_state", "period", "set_period", "codebook", "set_codebook", "global_step", "set_global_step",
    "count_empty_shard_step", "empty_shard_counters", "set_empty_shard_counters", "finalize_period",
    "fallback_enabled", "state_tensors", "CODEBOOK_FAMILIES", "codebook_family", "MUON_GROUP_KEYS", "MUON_REFUSED",
    "MUON_UPDATE_DTYPE", "MuonState", "ShardedGefenMuon", "new_gefen_muon", "set_sharded_step", "sharded_step",
    "is_gefen_muon", "muon_defaults", "muon_refused", "muon_deterministic", "muon_read", "muon_write", "muon_rows",
    "muon_set_rows", "muon_momentum", "muon_orthogonalize", "muon_normuon", "muon_apply", "muon_restore_group",
    "advance_global_step", "hybrid_defaults", "ns_schedule_names", "ns_schedule_coefficients",
]

K = schema.K  # codebook entries (gefen-x: num_codebooks=256)

# Keys of a stepped parameter's state that gefen_titan owns on load (everything
# but the name Gefen set at construction and its checkpoint-transport
# placeholders, which live state must keep; see docs/gefen_internals.md e).
_OWNED = ("automatic_period", "step", "vmean_step", "m_codebook", "m_magnitude", "vmean",
          "stepsize", "_h_buf", "v_row", "v_col", "factored_step")


@dataclass
class ParamState:
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


def is_gefen_family(optim: Optimizer) -> bool:
    """Gefen or any subclass of it."""
    return isinstance(optim, Gefen)


def named_params(optim: Optimizer) -> Iterator[tuple[str, torch.Tensor, dict]]:
    """(canonical name, param, group) in Gefen's param-group order.

    ``param_names`` is the container's list of FQNs (Gefen itself lowercases
    the names it stores, so we never use those).
    """
    for group in optim.param_groups:
        for name, p in zip(group["param_names"], group["params"], strict=True):
            yield name, p, group


def options(optim: Optimizer) -> dict[str, Any]:
    """The constructor options that change Gefen's arithmetic or layout."""
    return {
        "deterministic": bool(optim._deterministic),
        "factored_v_2d": bool(optim._factored_v_2d),
        "force_1d_period_one": bool(optim._force_1d_period_one),
        "force_2d_period_one": bool(optim._force_2d_period_one),
        "period_one_substrings": tuple(optim._period_one_substrings or ()),
        "codebook_refresh_every": int(optim._codebook_refresh_every or 0),
        "capturable": bool(optim.capturable),
    }


def has_state(optim: Optimizer, p: torch.Tensor) -> bool:
    return "m_codebook" in optim.state.get(p, {})


def read(optim: Optimizer, p: torch.Tensor) -> ParamState | None:
    """The parameter's quantized state, or None before its first step."""
    st = optim.state.get(p, {})
    if "m_codebook" not in st:
        return None
    if "v_row" in st or "factored_step" in st:
        raise ValueError("factored second moment (factored_v_2d) state is not supported by gefen_titan")
    return ParamState(
        period=int(st["automatic_period"]),
        step=int(st["step"]),
        vmean_step=int(st.get("vmean_step", st["step"])),
        codes=st["m_codebook"],
        magnitude=st["m_magnitude"],
        vmean=st["vmean"],
    )


def clear(optim: Optimizer, p: torch.Tensor) -> None:
    """Back to a never-stepped parameter (the name Gefen gave it stays)."""
    st = optim.state[p]
    for key in _OWNED:
        st.pop(key, None)


def write(optim: Optimizer, p: torch.Tensor, state: ParamState | None) -> None:
    """Replace the parameter's state (None: never stepped).

    Gefen reads ``m_codebook`` as ``[blocks, period]`` and the per-block
    tensors as ``[blocks, 1]`` and updates all three in place, so they must be
    contiguous tensors of exactly those shapes and dtypes.
    """
    clear(optim, p)
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


def period(optim: Optimizer, p: torch.Tensor) -> int | None:
    value = optim.state.get(p, {}).get("automatic_period")
    return None if value is None else int(value)


def set_period(optim: Optimizer, p: torch.Tensor, value: int) -> None:
    """Pre-set the block period; Gefen then skips its own search for ``p``."""
    optim.state[p]["automatic_period"] = int(value)


def codebook(optim: Optimizer) -> torch.Tensor | None:
    return optim._gefen_codebook


def set_codebook(optim: Optimizer, value: torch.Tensor | None) -> None:
    """Set the optimizer's codebook; with one set, Gefen learns none."""
    optim._gefen_codebook = value
    # Stale per-device copies would otherwise outlive the change.
    optim._gefen_codebook_by_device.clear()
    optim._gefen_codebook_lut_by_device.clear()


def global_step(optim: Optimizer) -> int:
    return int(optim._gefen_global_step)


def set_global_step(optim: Optimizer, value: int) -> None:
    optim._gefen_global_step = int(value)


def count_empty_shard_step(optim: Optimizer, p: torch.Tensor) -> None:
    """Advance the counters of a parameter whose local shard is empty.

    Gefen returns before touching the state of an empty local shard (an
    uneven FSDP split), so its ``step``/``vmean_step`` would stay behind the
    other ranks'. Agreed blocking keeps them equal on every rank, so a
    checkpoint's counters do not depend on which rank DCP keeps them from.
    Gefen never reads them for an empty shard.
    """
    step, vstep = empty_shard_counters(optim, p)
    set_empty_shard_counters(optim, p, step + 1, vstep + 1)


def empty_shard_counters(optim: Optimizer, p: torch.Tensor) -> tuple[int, int]:
    st = optim.state.get(p, {})
    return int(st.get("step", 0)), int(st.get("vmean_step", 0))


def set_empty_shard_counters(optim: Optimizer, p: torch.Tensor, step: int, vmean_step: int) -> None:
    st = optim.state[p]
    st["step"] = int(step)
    st["vmean_step"] = int(vmean_step)


def state_tensors(optim: Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor the optimizer holds as state (for size accounting)."""
    for group in optim.param_groups:
        for p in group["params"]:
            for value in optim.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    yield value
    cb = optim._gefen_codebook
    if isinstance(cb, torch.Tensor):
        yield cb


# ------------------------------------------------------------ period search
def finalize_period(results: list[tuple[int, float]]) -> int:
    """Gefen's own scoring of (period, error) candidates, ascending periods.

    The score of a candidate is the increase of its error over the previous
    candidate's; the smallest score wins (ties: the smaller period); a winner
    below 8 becomes 1 (``gefen.partitioning._finalize_period_results``).
    """
    return int(partitioning._finalize_period_results(results, print_results=False))


def fallback_enabled() -> bool:
    """gefen-x replaces a period-1 result by a coarse block (its memory-safe fallback)."""
    return bool(partitioning.MEMORY_SAFE_FALLBACK)


# ------------------------------------------------------------ codebook families
# Each gefen-x optimizer class learns its codebook from its own gradients:
# Gefen's from Gefen's, GefenMuon's from GefenMuon's. The agreement keeps one
# codebook per family for the whole job (index: ``codebook_family``).
CODEBOOK_FAMILIES = 2


def codebook_family(optim: Optimizer) -> int:
    """0 for Gefen, 1 for GefenMuon (exact types; anything else raises)."""
    if type(optim) is Gefen:
        return 0
    if isinstance(optim, GefenMuon):
        return 1
    raise TypeError(f"{type(optim).__name__} has no agreed codebook family")


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

# The group keys gefen_titan supports, checkpoints and restores on load.
MUON_GROUP_KEYS = MUON_HYPER

# GefenMuon options refused (as group keys and as constructor options): each
# makes the arithmetic depend on the layout or the machine, which the sharded
# step and the checkpoint's bit-exact resharding cannot keep.
MUON_REFUSED = {
    "sharded_mode": "gefen-titan shards GefenMuon itself (momentum on the parameter's shards, Newton-Schulz on "
                    "one owner rank); gefen-x's modes replicate the momentum or place it by world size",
    "fp8_ns": "fp8 Newton-Schulz runs only on sm_89+ GPUs above a matrix size, so results depend on the machine",
    "fp8_ns_compile": "it only configures fp8 Newton-Schulz, which is refused",
    "batched_ns": "batched Newton-Schulz changes the GEMM reduction order with the matrices a rank batches",
    "batched_ns_workspace_bytes": "it only configures batched Newton-Schulz, which is refused",
    "stochastic_round": "stochastic rounding draws its noise by position inside the local tensor, so it "
                        "changes with the shard layout",
    "cautious": "cautious masking needs the full gradient where Newton-Schulz runs, which is not gathered",
    "capturable": "capturable keeps the step counters on the device, and gefen-titan checkpoints host counters",
    "ns_schedule": "set ns_coefficients to the schedule's list of [a, b, c] instead (the record keeps those)",
}

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


class ShardedGefenMuon(GefenMuon):
    """gefen-x's GefenMuon whose ``step()`` is gefen-titan's sharded step.

    A subclass, not a container-level driver, so that every caller of
    ``step()`` (torchtitan's container loop, an LR scheduler's step
    tracking, the optimizer's own hooks) gets the sharded step and none can
    reach gefen-x's, which would gather full gradients and replace the
    sharded state.
    """

    sharded_step: Any = None  # set by the factory (``set_sharded_step``)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("GefenMuon under gefen-titan takes no closure")
        if self.sharded_step is None:
            raise RuntimeError("this GefenMuon has no sharded step: build it through gefen_titan.optim.registry")
        self.sharded_step()


def new_gefen_muon(param_groups: list[dict[str, Any]], **options: Any) -> Optimizer:
    """A ``ShardedGefenMuon(param_groups, **options)``: the one place gefen-titan constructs GefenMuon."""
    return ShardedGefenMuon(param_groups, **options)


def set_sharded_step(optim: Optimizer, step: Any) -> None:
    optim.sharded_step = step


def sharded_step(optim: Optimizer) -> Any:
    """The sharded step a ``ShardedGefenMuon`` runs (``set_sharded_step``'s)."""
    return optim.sharded_step


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
    adjustment comes from the parameter's global shape (gefen-x's
    ``_apply_muon_update`` with a pre-sliced update).
    """
    optim._apply_muon_update(group, p, update, isinstance(p, DTensor), True)


def muon_restore_group(group: dict, values: dict[str, Any]) -> None:
    """Set a GefenMuon group's ``MUON_GROUP_KEYS`` (a checkpoint's), keeping
    the ``beta1``/``beta2`` mirror of ``momentum`` that gefen-x's group keeps."""
    group.update({k: values[k] for k in MUON_GROUP_KEYS})
    group["beta1"], group["beta2"] = values["momentum"], 0.0


def advance_global_step(optim: Optimizer) -> None:
    """The per-optimizer step counter gefen-x's ``step()`` advances last."""
    optim._advance_gefen_global_step()


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
