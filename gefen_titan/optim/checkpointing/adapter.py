"""The ``StateAdapter`` seam, and the two-step load every adapter shares.

The container holds one adapter per optimizer kind with state of its own
(Gefen's, GefenMuon's: the registry entry's ``state`` picks it) and loads
them together: each ``stage_load`` checks what DCP read and keeps it,
noting a refusal in the phase's ``errors.Verdict``, which the container
settles once on every rank; only when every adapter has staged and nobody
refused does the container call ``commit_load`` on each. A refusal by one
kind therefore leaves every kind's live state as it was.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from gefen_titan.checkpoint.errors import GefenCheckpointError, Verdict, fall_back
from gefen_titan.checkpoint.format import digests, schema_records
from gefen_titan.distributed import all_gather_objects, is_distributed
from gefen_titan.optim.checkpointing.load_context import LoadContext

__all__ = ["StagedLoad", "StateAdapter", "blocking_refusal", "check_replicated"]


@runtime_checkable
class StateAdapter(Protocol):
    """The checkpointed state of one kind of optimizer on this rank.

    The container calls these on every rank, in the same order, whether or
    not the rank holds an optimizer of the kind (``state_dict`` may run
    collectives on a save; the load's methods run none: each phase's
    refusals go to its ``Verdict``, which the container settles).
    ``state_dict`` returns the entries to save, or, between
    ``prepare_load`` and ``commit_load``/``abort_load``, the destinations
    DCP loads into. ``prepare_load`` plans from the load's one read of the
    records (``LoadContext``), or notes why it cannot; ``stage_load`` checks
    what DCP read and stages it, or notes why not, changing nothing; ``commit_load``
    installs what was staged and cannot fail. Two steps, not one, because
    the container holds several adapters: none may commit until every one
    has staged, or a refusal by the second would leave the first's state loaded.
    """

    snapshot_on_save: bool
    """Hand DCP copies instead of views of live tensors (async saves write later)."""

    def state_dict(self) -> dict[str, Any]: ...

    def prepare_load(self, ctx: LoadContext, verdict: Verdict) -> None: ...

    def stage_load(self, state_dict: dict[str, Any], verdict: Verdict) -> None: ...

    def commit_load(self) -> None: ...

    def abort_load(self) -> None: ...


def blocking_refusal(header: schema_records.Header, blocking: str) -> str:
    """Why a run of ``optimizer.blocking.mode = blocking`` cannot load a checkpoint of the other blocking."""
    return (f"it was written with optimizer.blocking.mode = \"{header.implied_blocking}\" "
            f"(format v{header.version}) and the recipe sets \"{blocking}\"; resume with "
            f"optimizer.blocking.mode = \"{header.implied_blocking}\" (or "
            "start the optimizer fresh with checkpoint.exclude_from_loading = [\"optimizer\"])")


class StagedLoad(ABC):
    """A ``StateAdapter``'s load, in the same steps for every kind.

    ``prepare_load`` refuses a checkpoint whose format this kind cannot
    read (only where the rank holds parameters of the kind) and plans
    (``_plan_from``) on every rank alike; ``state_dict`` then hands DCP the
    plan's destinations; ``stage_load`` turns what DCP read into staged
    state (``_stage``) after an all-ranks agreement; ``commit_load``
    installs it (``_commit``); ``abort_load`` drops both. A kind supplies
    those three hooks, its saves (``_save``), and ``slots``.
    """

    kind: ClassVar[str]
    """The optimizer's name in messages."""
    formats: ClassVar[tuple[int, ...]]
    """The format versions it loads (``schema.VERSIONS``)."""

    slots: list
    snapshot_on_save: bool = False
    _loading: bool = False
    _plan: Any = None
    _staged: tuple[Any, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self._loading:
            return self._load_destinations(self._plan) if self._plan is not None else {}
        return self._save()

    def prepare_load(self, ctx: LoadContext, verdict: Verdict) -> None:
        """Check the format and plan this rank's load; a refusal is noted in ``verdict``."""
        plan = None
        if self.slots and verdict.ok:
            try:
                self._check_format(ctx)
                plan = self._plan_from(ctx)
            except (GefenCheckpointError, ValueError, KeyError) as e:
                verdict.refuse(f"{self.kind} state: {e}")
        self._loading, self._plan, self._checkpoint_id = True, plan, ctx.checkpoint_id

    def stage_load(self, state_dict: dict[str, Any], verdict: Verdict) -> None:
        if not self._loading:
            if self.slots:
                raise GefenCheckpointError(
                    f"{self.kind} state can only be loaded through GefenCheckpointManager (which reads the "
                    "checkpoint's records first); set the recipe's [checkpoint] as usual")
            return  # nothing of this kind here: a plain load (no manager) of the other optimizers goes on
        plan, self._plan, self._loading = self._plan, None, False
        staged = None
        if plan is not None and verdict.ok:
            try:
                staged = self._stage(plan, state_dict)
            except (GefenCheckpointError, ValueError, KeyError) as e:  # what was read is damaged
                verdict.refuse(f"{self.kind} state: {e}; {fall_back(self._checkpoint_id, digests.step_problem)}")
        self._staged = (plan, staged) if plan is not None and verdict.ok else None

    def commit_load(self) -> None:
        if self._staged is not None:
            plan, staged = self._staged
            self._staged = None
            self._commit(plan, staged)

    def abort_load(self) -> None:
        self._loading, self._plan, self._staged = False, None, None

    def _check_format(self, ctx: LoadContext) -> None:
        if ctx.header is None:
            foreign = ctx.foreign_keys()[:3]
            what = (f"it holds another optimizer's state ({', '.join(foreign)} ...)" if foreign
                    else f"it holds no {self.kind} state in the gefen-titan format")
            raise GefenCheckpointError(
                f"{what}. To start {self.kind} fresh from this checkpoint's model, set "
                "checkpoint.exclude_from_loading = [\"optimizer\"] (and lr_scheduler if needed)")
        if ctx.header.version not in self.formats:
            raise GefenCheckpointError(self._format_refusal(ctx.header))

    def _format_refusal(self, header: schema_records.Header) -> str:
        return (f"the checkpoint is format v{header.version} ({header.implied_blocking} blocking), which holds "
                f"no {self.kind} state")

    @abstractmethod
    def _save(self) -> dict[str, Any]: ...

    @abstractmethod
    def _plan_from(self, ctx: LoadContext) -> Any: ...

    @abstractmethod
    def _load_destinations(self, plan: Any) -> dict[str, Any]: ...

    @abstractmethod
    def _stage(self, plan: Any, state_dict: dict[str, Any]) -> Any: ...

    @abstractmethod
    def _commit(self, plan: Any, staged: Any) -> None: ...


def check_replicated(sd: dict[str, Any], what: str) -> None:
    """Entries written by several ranks must be equal: DCP keeps one copy. Collective."""
    if not is_distributed():
        return
    mine = {}
    for key, value in sd.items():
        if isinstance(value, str):
            mine[key] = hashlib.sha1(value.encode()).hexdigest()
        elif isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            mine[key] = hashlib.sha1(value.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
    everyone = all_gather_objects(mine)
    seen: dict[str, str] = {}
    bad = set()
    for ranks in everyone:
        for key, digest in ranks.items():
            if seen.setdefault(key, digest) != digest:
                bad.add(key)
    if bad:
        raise GefenCheckpointError(
            f"cannot save {what} optimizer state: ranks disagree on {sorted(bad)[:3]} (codebook, "
            "periods or counters differ between ranks, so the state is not the agreed one); "
            "nothing was written")
