"""How an optimizer's state becomes checkpoint entries, and back.

The optimizer container checkpoints every registered optimizer that keeps
state of its own shape (``OptimizerSpec.state``) through a ``StateAdapter``,
and every other optimizer through torchtitan's flat per-parameter state dict.
Gefen's adapter is ``GefenState``; which of the two format versions it
writes follows ``optimizer.blocking``, which one it reads follows the
checkpoint's header:

* ``agreed``: formats v3 (written) and v2 (loaded) under agreed blocking and resharded by DCP
  alone (a load is DCP plus views);
* ``per_rank``: format v1, written under per-rank blocking and re-blocked
  (requantized where the layout changed) on load.

GefenMuon's adapter is ``MuonStateAdapter`` (formats v2 and v3). Before any
adapter plans a load, ``check_kinds`` refuses a checkpoint that saved a live
parameter under another of these optimizers (a GefenMuon checkpoint into a
Gefen recipe, or the reverse), saying what to set.

The entries' keys and records are defined in ``gefen_titan.checkpoint.schema``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch.optim import Optimizer

from gefen_titan.checkpoint import schema
from gefen_titan.checkpoint.errors import GefenCheckpointError, refuse_on_any_rank
from gefen_titan.checkpoint.storage import read_small
from gefen_titan.optim.state.agreed import AgreedStateAdapter
from gefen_titan.optim.state.muon import MuonStateAdapter
from gefen_titan.optim.state.per_rank import PerRankStateAdapter

__all__ = ["AgreedStateAdapter", "GefenState", "MuonStateAdapter", "PerRankStateAdapter", "StateAdapter",
           "FLAT_KIND", "checkpoint_blocking", "check_kinds"]

# The record kinds of the format (``schema.parse_key``) -> the optimizer that wrote them.
_SAVED_BY = {"optimizer": "Gefen", "muon": "GefenMuon"}


@runtime_checkable
class StateAdapter(Protocol):
    """The checkpointed state of one kind of optimizer on this rank.

    The container calls these on every rank, in the same order, whether or
    not the rank holds an optimizer of the kind (the methods may run
    collectives). ``state_dict`` returns the entries to save, or, between
    ``prepare_load`` and ``commit_load``/``abort_load``, the destinations
    DCP loads into. ``stage_load`` checks what DCP read and stages it, or
    raises on every rank, changing nothing; ``commit_load`` installs what
    was staged and cannot fail. Two steps, not one, because the container
    holds several adapters (Gefen's, GefenMuon's): none may commit until
    every one has staged, or a refusal by the second would leave the first's
    state loaded.
    """

    snapshot_on_save: bool
    """Hand DCP copies instead of views of live tensors (async saves write later)."""

    def state_dict(self) -> dict[str, Any]: ...

    def stage_load(self, state_dict: dict[str, Any]) -> None: ...

    def commit_load(self) -> None: ...

    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str) -> None: ...

    def abort_load(self) -> None: ...


def checkpoint_blocking(checkpoint_id: str, metadata: Any, prefix: str, has_gefen: bool) -> str:
    """``"agreed"`` (format v2 or v3) or ``"per_rank"`` (v1) for a checkpoint. Collective.

    Raises ``GefenCheckpointError`` on every rank when the checkpoint holds no
    gefen-titan Gefen state that a rank with Gefen parameters could load.
    """
    key = schema.header_key()
    error, blocking = None, None
    if prefix + key not in metadata.state_dict_metadata:
        foreign = sorted(k[len(prefix):] for k in metadata.state_dict_metadata
                         if k.startswith(prefix + "state."))[:3]
        what = (f"it holds another optimizer's state ({', '.join(foreign)} ...)" if foreign
                else "it holds no Gefen state in the gefen-titan format")
        if has_gefen:
            error = (f"{what}. To start Gefen fresh from this checkpoint's model, set "
                     "checkpoint.exclude_from_loading = [\"optimizer\"] (and lr_scheduler if needed)")
    else:
        try:
            raw = read_small(checkpoint_id, metadata, prefix, [], [key])[key]
            blocking = schema.Header.from_json(raw).implied_blocking
        except schema.FormatError as e:
            error = str(e)
    refuse_on_any_rank(error, f"cannot load Gefen optimizer state from {checkpoint_id}")
    return blocking or "agreed"


# The kind a checkpoint's flat torch state (``state.<fqn>.*``, ``param_groups.<fqn>.*``:
# AdamW, Adam) is reported as; a live optimizer without records of its own is of it.
FLAT_KIND = "AdamW"


def check_kinds(checkpoint_id: str, metadata: Any, prefix: str, live: dict[str, str],
                hint: Callable[[str, str], str] | None = None) -> None:
    """Refuse, on every rank, a checkpoint that saved a live parameter under
    another optimizer kind (``live``: fqn -> the registry name stepping it;
    the kinds without records of their own, AdamW and Adam, count as one,
    ``FLAT_KIND``, since their flat state is the same). Collective.

    Without this check the adapters would each see parameters without state
    of their own kind and call the checkpoint foreign (or DCP would miss the
    flat keys); the fix is a setting, which the message names (``hint(was,
    now)`` adds the one its caller knows, e.g. GefenMuonHybrid's keys).
    """
    keys = sorted(k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix))
    records = [k for k in keys if (pk := schema.parse_key(k)) is not None and pk.kind in _SAVED_BY]
    small = read_small(checkpoint_id, metadata, prefix, [], records)
    error = None
    try:
        saved = {fqn: _SAVED_BY[schema.parse_key(k).kind] for k in records
                 for fqn in schema.record_fqns(small[k], f"optimizer record {k}")}
        present = set(keys)
        saved.update({fqn: FLAT_KIND for fqn in live if fqn not in saved and f"param_groups.{fqn}.lr" in present})
        moved: dict[tuple[str, str], list[str]] = {}
        for fqn, kind in live.items():
            kind = kind if kind in _SAVED_BY.values() else FLAT_KIND
            if saved.get(fqn, kind) != kind:
                moved.setdefault((saved[fqn], kind), []).append(fqn)
        error = "; ".join(
            f"{len(fqns)} parameter(s) ({', '.join(sorted(fqns)[:3])}{' ...' if len(fqns) > 3 else ''}) were saved "
            f"by {was} and the recipe gives them to {now}: "
            + ((hint(was, now) + ", or ") if hint is not None and hint(was, now) else "")
            + f"give them to {was} again (a [[optimizer.param_groups]] entry with optimizer_name = \"{was}\" "
            "whose pattern matches them, as in the run that wrote it), or start the optimizer fresh with "
            "checkpoint.exclude_from_loading = [\"optimizer\"]" for (was, now), fqns in sorted(moved.items())) or None
    except schema.FormatError as e:
        error = str(e)
    refuse_on_any_rank(error, f"cannot load optimizer state from {checkpoint_id}")


class GefenState:
    """Gefen's ``StateAdapter``: format v3 under agreed blocking (v2 loads too), v1 under per-rank blocking.

    Saves write the run's own format. A load reads the checkpoint's header
    first and refuses, on every rank, a checkpoint of the other blocking (its
    state could not be what this run's blocking keeps).
    """

    def __init__(self, optimizers: list[Optimizer], blocking: str) -> None:
        self.optimizers = optimizers
        self.blocking = blocking
        self._save = AgreedStateAdapter(optimizers) if blocking == "agreed" else PerRankStateAdapter(optimizers)
        self._loading: AgreedStateAdapter | PerRankStateAdapter | None = None

    @property
    def snapshot_on_save(self) -> bool:
        return self._save.snapshot_on_save

    @snapshot_on_save.setter
    def snapshot_on_save(self, value: bool) -> None:
        self._save.snapshot_on_save = value

    def state_dict(self) -> dict[str, Any]:
        return (self._loading or self._save).state_dict()

    def stage_load(self, state_dict: dict[str, Any]) -> None:
        if self._loading is None:
            if not self.optimizers:
                return
            raise GefenCheckpointError(
                "Gefen state can only be loaded through GefenCheckpointManager (which reads the "
                "checkpoint's records first); set the recipe's [checkpoint] as usual")
        self._loading.stage_load(state_dict)

    def commit_load(self) -> None:
        loading, self._loading = self._loading, None
        if loading is not None:
            loading.commit_load()

    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str) -> None:
        """Pick the adapter for the checkpoint's format and let it plan the load. Collective."""
        has_gefen = bool(self.optimizers)
        blocking = checkpoint_blocking(checkpoint_id, metadata, prefix, has_gefen)
        error = None
        if has_gefen and blocking != self.blocking:
            error = (
                f"it was written with optimizer.blocking = \"{blocking}\" (format "
                f"v{schema.Header.for_blocking(blocking).version}) and the recipe sets \"{self.blocking}\"; "
                f"resume with optimizer.blocking = \"{blocking}\" (or start the optimizer fresh with "
                "checkpoint.exclude_from_loading = [\"optimizer\"])")
        refuse_on_any_rank(error, f"cannot load Gefen optimizer state from {checkpoint_id}")
        adapter = AgreedStateAdapter(self.optimizers) if blocking == "agreed" else PerRankStateAdapter(self.optimizers)
        adapter.prepare_load(checkpoint_id, metadata, prefix)
        self._loading = adapter

    def abort_load(self) -> None:
        if self._loading is not None:
            self._loading.abort_load()
        self._loading = None
