"""The one place that reads and writes gefen-x's private optimizer state,
and the one package that imports gefen-x at all (``lint-imports`` checks it):
Gefen's accessors in ``gefen``, GefenMuon's in ``muon``, the CPU kernel's hook into
their steps in ``routing``, all re-exported here
(callers use ``from gefen_titan.optim import gefenx as gx``).

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

from gefen_titan.optim.gefenx.gefen import (
    FQNS_KEY,
    LIVE_BLOCK_FLOATS,
    STATE_COST,
    K,
    ParamState,
    clear,
    codebook,
    codebook_tensors,
    count_empty_shard_step,
    empty_shard_counters,
    fallback_enabled,
    finalize_period,
    global_step,
    has_state,
    is_gefen,
    is_gefen_family,
    named_params,
    new_gefen,
    options,
    period,
    read,
    set_codebook,
    set_empty_shard_counters,
    set_global_step,
    set_period,
    state_tensors,
    write,
)
from gefen_titan.optim.gefenx.muon import (
    MUON_GROUP_KEYS,
    MUON_REFUSED,
    MUON_STATE_COST,
    MUON_UPDATE_DTYPE,
    NORMUON_ROW_BYTES,
    MuonState,
    ShardedGefenMuon,
    ShardedStep,
    advance_global_step,
    hybrid_defaults,
    is_gefen_muon,
    muon_apply,
    muon_defaults,
    muon_deterministic,
    muon_momentum,
    muon_normuon,
    muon_orthogonalize,
    muon_read,
    muon_refused,
    muon_restore_group,
    muon_rows,
    muon_set_rows,
    muon_write,
    new_gefen_muon,
    ns_schedule_coefficients,
    ns_schedule_names,
    sharded_step,
)
from gefen_titan.optim.gefenx.routing import route_cpu_step

__all__ = [
    "FQNS_KEY", "K", "ParamState", "is_gefen", "is_gefen_family", "new_gefen", "named_params", "options", "read",
    "write",
    "clear", "has_state", "period", "set_period", "codebook", "set_codebook", "global_step", "set_global_step",
    "count_empty_shard_step", "empty_shard_counters", "set_empty_shard_counters", "finalize_period",
    "fallback_enabled", "state_tensors", "codebook_tensors", "LIVE_BLOCK_FLOATS", "STATE_COST",
    "MUON_STATE_COST", "NORMUON_ROW_BYTES", "MUON_GROUP_KEYS", "MUON_REFUSED",
    "MUON_UPDATE_DTYPE", "MuonState", "ShardedGefenMuon", "new_gefen_muon", "ShardedStep", "sharded_step",
    "is_gefen_muon", "muon_defaults", "muon_refused", "muon_deterministic", "muon_read", "muon_write", "muon_rows",
    "muon_set_rows", "muon_momentum", "muon_orthogonalize", "muon_normuon", "muon_apply", "muon_restore_group",
    "advance_global_step", "hybrid_defaults", "ns_schedule_names", "ns_schedule_coefficients", "route_cpu_step",
]
