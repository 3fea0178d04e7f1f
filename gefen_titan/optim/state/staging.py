"""What the state adapters share: the two-step load, and (formats v2, v3) the
parameter slots and the checked save.

The container holds one adapter per optimizer kind (Gefen's, GefenMuon's)
and loads them together (``StateAdapter``): each ``stage_load`` checks what
DCP read and keeps it, raising on every rank if anything is wrong; only when
every adapter has staged does the container call ``commit_load`` on each.
A refusal by one kind therefore leaves every kind's live state as it was.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from gefen_titan.checkpoint import schema
from gefen_titan.checkpoint.errors import GefenCheckpointError, refuse_on_any_rank
from gefen_titan.checkpoint.storage import read_small
from gefen_titan.distributed import all_gather_objects, is_distributed, local
from gefen_titan.optim import gefenx as gx

__all__ = ["AgreedAdapter", "Slot", "StagedLoad", "check_replicated"]


class StagedLoad(ABC):
    """``prepare_load`` sets ``_plan``; ``stage_load`` turns it and what DCP
    read into ``_staged`` (after an all-ranks agreement); ``commit_load``
    installs it through ``_commit``; ``abort_load`` drops both."""

    _plan: Any = None
    _staged: tuple[Any, Any] | None = None

    def commit_load(self) -> None:
        if self._staged is not None:
            plan, staged = self._staged
            self._staged = None
            self._commit(plan, staged)

    def abort_load(self) -> None:
        self._plan = self._staged = None

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


@dataclass
class Slot:
    """One live parameter of an optimizer of the adapter's kind on this rank."""

    fqn: str
    param: torch.Tensor
    optim: Optimizer
    opt_id: str  # the optimizer's first parameter's name: its records' key
    group: dict

    @property
    def local(self) -> torch.Tensor:
        return local(self.param)


class AgreedAdapter(StagedLoad):
    """A format v2/v3 adapter over the optimizers ``owns`` picks: its slots, and
    ``state_dict`` (the entries to save, checked and agreed on every rank, or
    between ``prepare_load`` and the commit, DCP's load destinations)."""

    kind: ClassVar[str]  # the optimizer's name in messages
    record_kind: ClassVar[str]  # schema.parse_key's kind of its optimizer records
    codebook_kind: ClassVar[str]  # ... and of its codebooks

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.optimizers = [o for o in optimizers if self.owns(o)]
        self.slots: list[Slot] = []
        for optim in self.optimizers:
            named = list(gx.named_params(optim))
            opt_id = named[0][0] if named else ""
            self.slots += [Slot(fqn, p, optim, opt_id, group) for fqn, p, group in named]
        # Set by GefenCheckpointManager for async saves, which write after
        # the next step has mutated the optimizer's tensors in place.
        self.snapshot_on_save = False

    @staticmethod
    @abstractmethod
    def owns(optim: Optimizer) -> bool: ...

    def state_dict(self) -> dict[str, Any]:
        if self._plan is not None:
            return self._load_destinations()
        sd: dict[str, Any] = {}
        error = None
        try:
            sd = self._save_entries()
        except (GefenCheckpointError, ValueError) as e:
            error = str(e)
        refuse_on_any_rank(error, f"cannot save {self.kind} optimizer state")
        check_replicated(sd, self.kind)
        return sd

    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str) -> None:
        """Read and check the records; fix the destinations (``_plan_from``). Collective."""
        ours = {k[len(prefix):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
        parsed = {k: schema.parse_key(k) for k in ours}
        rec_keys = sorted(k for k, pk in parsed.items() if pk and pk.kind == self.record_kind)
        books = sorted(k for k, pk in parsed.items() if pk and pk.kind == self.codebook_kind)
        header = [schema.header_key()] if schema.header_key() in ours else []
        small = read_small(checkpoint_id, metadata, prefix, books, rec_keys + header)
        plan, error = None, None
        try:
            version = schema.Header.from_json(small[header[0]]).version if header else schema.VERSION
            if version not in schema.AGREED_VERSIONS:
                if self.slots:  # (Gefen's own adapter is chosen by the header: only GefenMuon gets here)
                    raise GefenCheckpointError(
                        f"the checkpoint is format v{version} (per-rank blocking), which holds no {self.kind} state")
                version = schema.VERSION  # nothing of this kind to load
            plan = self._plan_from(checkpoint_id, small, ours, rec_keys, books, version)
        except (GefenCheckpointError, ValueError) as e:
            error = str(e)
        refuse_on_any_rank(error, f"cannot load {self.kind} optimizer state from {checkpoint_id}")
        self._plan = plan

    @abstractmethod
    def _plan_from(self, checkpoint_id: str, small: dict[str, Any], ours: dict[str, Any], rec_keys: list[str],
                   books: list[str], version: int) -> Any:
        """The load's plan; ``version``: the checkpoint's (``schema.AGREED_VERSIONS``)."""

    @abstractmethod
    def _save_entries(self) -> dict[str, Any]: ...

    @abstractmethod
    def _load_destinations(self) -> dict[str, Any]: ...
