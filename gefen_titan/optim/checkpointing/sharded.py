"""Formats v2 and v3: an optimizer kind's state sharded like its parameters, resharded by DCP alone.

Under agreed blocking (``gefen_titan.optim.blocking``) every rank holds the
kind's one codebook and the same period per parameter, and no block
crosses a shard cut of any allowed layout. Each rank's state is then a
slice of one global state: every state tensor is a DTensor with (a view
of) the parameter's placements. Saving hands DCP views of them; loading asks
DCP for the live placements and installs what it read, so a resume at any
FSDP / TP / HSDP / pipeline layout is bit-exact and costs no more than
reading the bytes.

``ShardedAdapter`` is all of that which does not depend on the kind: the
parameter slots, the save (the header, one record and one codebook per
optimizer, checked and agreed), and the load's plan checks that need the
live model (the records cover every live parameter with its shape and
``deterministic``; periods divide and fit every cut; every entry a record
implies is present with its local shape), its destinations and the commit
of the codebook and global step. The records themselves (parsed; counters,
hyperparameters, codebooks valid and one) are the load's records stage's,
run once by the kind's description (``checkpoint.format.kinds``) for the load and
``ckpt verify`` alike: the plan reads them from ``LoadContext.saved``. A
kind supplies its record kinds, its tensors and its save and install.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from gefen_titan.checkpoint.errors import GefenCheckpointError, other_model_advice, refuse_on_any_rank
from gefen_titan.checkpoint.format import kinds, schema, schema_records
from gefen_titan.distributed import like_param, local
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.block_periods import check_period_fits
from gefen_titan.optim.checkpointing.adapter import StagedLoad, check_replicated
from gefen_titan.optim.checkpointing.load_context import LoadContext

__all__ = ["Plan", "ShardedAdapter", "Slot", "check_finite_nonnegative"]


@dataclass
class Slot:
    """One live parameter of an optimizer of the adapter's kind on this rank."""

    fqn: str
    param: torch.Tensor
    optim: Optimizer
    opt_id: str  # schema.optimizer_id: its records' key
    group: dict

    @property
    def local(self) -> torch.Tensor:
        return local(self.param)


@dataclass
class Plan:
    """A load's plan: what the records say, checked against the live slots."""

    records: dict[str, Any]  # fqn -> the saved parameter record (the kind's type)
    codebook: torch.Tensor | None
    global_steps: dict[str, int]  # saved opt id -> global step
    source_opt: dict[str, str]  # fqn -> saved opt id
    version: int  # schema.AGREED_VERSIONS


def check_finite_nonnegative(fqn: str, what: str, t: torch.Tensor | None) -> None:
    """Magnitudes and second moments are finite and >= 0 in any state Gefen's arithmetic made
    (``kinds.nonnegative_problem``: ``ckpt verify`` runs the same check)."""
    why = None if t is None else kinds.nonnegative_problem(t)
    if why:
        raise GefenCheckpointError(
            f"{fqn}: non-finite or negative {what} in the checkpoint ({why}; corrupt file)")  # the load adds what to do


class ShardedAdapter(StagedLoad):
    """A format v2/v3 adapter over the optimizers ``owns`` picks (see the module docstring)."""

    formats = schema.AGREED_VERSIONS
    record_kind: ClassVar[str]
    """``schema.parse_key``'s kind of its optimizer records ..."""
    codebook_kind: ClassVar[str]
    """... and of its codebooks."""
    codebook_what: ClassVar[str]
    """Its codebook in messages ("codebook", "GefenMuon codebook")."""
    owns: ClassVar[Callable[[Optimizer], bool]]

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.optimizers = [o for o in optimizers if type(self).owns(o)]
        self.slots: list[Slot] = []
        for optim in self.optimizers:
            named = list(gx.named_params(optim))
            opt_id = schema.optimizer_id([fqn for fqn, _, _ in named])
            self.slots += [Slot(fqn, p, optim, opt_id, group) for fqn, p, group in named]
        # Set by GefenCheckpointManager for async saves, which write after
        # the next step has mutated the optimizer's tensors in place.
        self.snapshot_on_save = False

    # ------------------------------------------------------------ the kind's hooks
    @abstractmethod
    def _deterministic(self, optim: Optimizer) -> bool:
        """The live optimizer's ``deterministic`` (it changes the arithmetic: a resume must keep it)."""

    @abstractmethod
    def _tensor_specs(self, fqn: str, shape: tuple[int, ...], rec: Any, version: int
                      ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """A stateful parameter's entries at ``shape`` (global or local): key -> (dtype, shape)."""

    def _placed(self, s: Slot, key: str, tensor: torch.Tensor, global_shape: tuple[int, ...]) -> Any:
        """A local tensor of an entry as DCP's DTensor (default: the parameter's placements)."""
        return like_param(s.param, tensor, global_shape)

    @abstractmethod
    def _save_param(self, s: Slot) -> tuple[Any, dict[str, torch.Tensor]]:
        """(its record, its entries by key: local tensors; none without state)."""

    @abstractmethod
    def _optimizer_record(self, optim: Optimizer, params: list[Any]) -> Any: ...

    @abstractmethod
    def _stage_param(self, s: Slot, rec: Any, tensors: dict[str, torch.Tensor], version: int) -> Any:
        """The state to install from a stateful parameter's entries (local tensors by key)."""

    @abstractmethod
    def _install(self, s: Slot, staged: Any, rec: Any) -> None:
        """Install a parameter's staged state (None: no state) and its record's group keys."""

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone() if self.snapshot_on_save else t

    # ------------------------------------------------------------------ save
    def _save(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        error = None
        try:
            sd = self._save_entries()
        except (GefenCheckpointError, ValueError) as e:
            error = str(e)
        refuse_on_any_rank(error, f"cannot save {self.kind} optimizer state")
        check_replicated(sd, self.kind)
        return sd

    def _save_entries(self) -> dict[str, Any]:
        if not self.slots:
            return {}
        sd: dict[str, Any] = {schema.header_key(): schema_records.Header.for_blocking("agreed").to_json()}
        books = {id(o): gx.codebook(o) for o in self.optimizers}
        present = [b for b in books.values() if b is not None]
        if any(not torch.equal(present[0].cpu(), b.cpu()) for b in present[1:]):
            raise GefenCheckpointError(
                f"the {self.kind} optimizers of this rank hold different codebooks; agreed blocking gives "
                f"the job one {self.codebook_what} (was state loaded or edited outside gefen_titan?)")
        for optim in self.optimizers:
            slots = [s for s in self.slots if s.optim is optim]
            params = []
            for s in slots:
                rec, entries = self._save_param(s)
                params.append(rec)
                specs = self._tensor_specs(s.fqn, tuple(s.param.shape), rec, schema.VERSION) if entries else {}
                for key, tensor in entries.items():
                    sd[key] = self._placed(s, key, tensor, specs[key][1])
            opt_id = slots[0].opt_id
            sd[schema.entry_key(self.record_kind, opt_id)] = self._optimizer_record(optim, params).to_json()
            if books[id(optim)] is not None:
                sd[schema.entry_key(self.codebook_kind, opt_id)] = books[id(optim)].detach().float().cpu().clone()
        return sd

    # ------------------------------------------------------------------ load
    def _plan_from(self, ctx: LoadContext) -> Plan:
        # The records as the load's records stage parsed and checked them (checkpoint.checks.record_checks,
        # by the kind's description: counters, hyperparameters, codebooks; what ckpt verify runs), so
        # none is parsed or checked twice. What it refuses it refuses after these model-aware checks
        # (LoadContext.records_refusal); a check here that a record the stage dropped would fail
        # names the stage's refusal instead.
        records, source_opt, global_steps, deterministic = {}, {}, {}, {}
        mine = ctx.saved.kinds.get(self.kind) if ctx.saved is not None else None
        for o in mine.optimizers if mine is not None else ():
            global_steps[o.opt], deterministic[o.opt] = o.global_step, o.deterministic
            for p in o.params:
                records[p.fqn], source_opt[p.fqn] = p, o.opt
        codebook = next(iter(mine.codebooks.values()), None) if mine is not None else None
        missing = [s.fqn for s in self.slots if s.fqn not in records]
        if missing:
            extra = sorted(set(records) - {s.fqn for s in self.slots})

            resized = next((f"; {s.fqn} is {tuple(records[s.fqn].shape)} there and {tuple(s.param.shape)} here"
                            for s in self.slots if s.fqn in records
                            and tuple(records[s.fqn].shape) != tuple(s.param.shape)), "")

            def few(names: list[str]) -> str:
                return f"({', '.join(names[:4])}{' ...' if len(names) > 4 else ''})"
            raise GefenCheckpointError(ctx.records_refusal or other_model_advice(
                f"it has no {self.kind} state for {len(missing)} live parameter(s) {few(missing)}"
                + (f" and holds {len(extra)} this model lacks {few(extra)}" if extra else "") + resized))
        version = ctx.header.version
        for s in self.slots:
            rec, src = records[s.fqn], source_opt[s.fqn]
            shape = tuple(s.param.shape)
            if rec.shape != shape:
                raise GefenCheckpointError(other_model_advice(
                    f"{s.fqn} is {tuple(rec.shape)} there and {shape} here"))
            live_det = self._deterministic(s.optim)
            if deterministic[src] != live_det:
                raise GefenCheckpointError(
                    f"the checkpoint was written with optimizer.deterministic = {deterministic[src]} and "
                    f"the recipe sets {live_det}; they change {self.kind}'s arithmetic: resume with "
                    f"optimizer.deterministic = {str(deterministic[src]).lower()}")
            if not rec.period:
                continue
            if codebook is None:
                raise GefenCheckpointError(ctx.records_refusal or
                                           f"the checkpoint holds {self.kind} state but no codebook (truncated?)")
            if shape and shape[-1] % rec.period:
                raise GefenCheckpointError(f"{s.fqn}: period {rec.period} does not divide the last dimension")
            why = check_period_fits(s.fqn, s.param, rec.period)
            if why:
                raise GefenCheckpointError(why)
            for key, (_, want) in self._tensor_specs(s.fqn, shape, rec, version).items():
                md = ctx.entries.get(key)
                if md is None:
                    raise GefenCheckpointError(f"{s.fqn}: {key} missing from the checkpoint (truncated or foreign)")
                if tuple(md.size) != want:
                    raise GefenCheckpointError(
                        f"{s.fqn}: {key} has shape {tuple(md.size)}, expected {want} for period {rec.period}")
        return Plan(records, codebook, global_steps, source_opt, version)

    def _load_destinations(self, plan: Plan) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for s in self.slots:
            rec = plan.records[s.fqn]
            if not rec.period:
                continue
            # The same entries at the local shard's shape (periods fit every cut: checked in _plan_from).
            here = self._tensor_specs(s.fqn, tuple(s.local.shape), rec, plan.version)
            for key, (dtype, want) in self._tensor_specs(s.fqn, tuple(s.param.shape), rec, plan.version).items():
                sd[key] = self._placed(s, key, torch.empty(here[key][1], dtype=dtype, device=s.local.device), want)
        return sd

    def _stage(self, plan: Plan, sd: dict[str, Any]) -> dict[str, Any]:
        staged = {}
        for s in self.slots:
            rec = plan.records[s.fqn]
            if not rec.period:
                staged[s.fqn] = None
                continue
            tensors = {key: local(sd[key]) for key in self._tensor_specs(s.fqn, tuple(s.local.shape), rec,
                                                                                 plan.version)}
            staged[s.fqn] = self._stage_param(s, rec, tensors, plan.version)
        return staged

    def _commit(self, plan: Plan, staged: dict[str, Any]) -> None:
        for s in self.slots:
            self._install(s, staged[s.fqn], plan.records[s.fqn])
        for optim in self.optimizers:
            mine = [s for s in self.slots if s.optim is optim]
            if any(staged[s.fqn] is not None for s in mine):
                gx.set_codebook(optim, plan.codebook.to(mine[0].local.device).clone())
            else:
                gx.set_codebook(optim, None)
            gx.set_global_step(optim, max((plan.global_steps[plan.source_opt[s.fqn]] for s in mine), default=0))
