"""Opt-in hooks for the reshard validation (``gefen_titan.validation.command``) and the resume tests.

``dump_state``: dump state around checkpoints.

A torchtitan config override (``torchtitan.config.override``) that swaps the
recipe's ``GefenCheckpointManager`` for a subclass which, after a successful
load and after the saves of chosen steps, writes the raw training state to
``<dir>``. What it writes follows the run's ``optimizer.blocking``:

* **agreed** (checkpoint format v3): the *global* state, so that a load at
  another layout can be compared with the save bit for bit. Every entry of
  the optimizer container's ``state_dict()`` (what the checkpoint stores:
  each kind's tensors as DTensors with the parameter's placements, its JSON
  records and codebooks, and the flat state of torch's optimizers, e.g. the
  AdamW groups of mixed recipes) is gathered with ``full_tensor()``, and so
  is every parameter; besides, every rank's live facts of each kind that
  has them (its registry entry's ``validation.live_facts``: Gefen's periods,
  counters, hyperparameters, codebooks and global steps) are gathered from
  all ranks. One rank per distinct set of entries writes
  ``<kind>-<step>-global-rank<r>.pt`` (rank 0 only, unless pipeline stages
  hold different parameters). This is collective: every rank takes part.
* **per_rank** (format v1): each rank's own picture,
  ``<kind>-<step>-rank<r>.pt``: every parameter's local shard and where it
  lies in the flattened parameter (``gefen_titan.optim.kinds.gefen.per_rank_regions.param_region``),
  each kind's own picture of its state (its ``validation.rank_state``),
  and the tensors of torch's optimizers' state.

Both record the wall time of the save or load (DCP call included, the dump
excluded). The kinds are found through the registry
(``gefen_titan.optim.registry``), which is how this module names none.

Nothing is active unless a run lists it (torchtitan's command-line form: one
token per target, ``target=<json>`` for its arguments), e.g.::

    --override.imports gefen_titan.patches.sdpa_attention.sdpa_attention \
        'gefen_titan.validation.hooks.dump_state={"dir": "/tmp/d", "save_steps": [4]}'

It reads the live objects only (copies are written, nothing is changed);
training, saving and loading are torchtitan's and ``GefenCheckpointManager``'s,
unchanged.

``record_batches``: with the global-order loader, every rank appends, for each
microbatch it reads, the stream position, its data-parallel rank and the
global sample ids to ``<dir>/batches-dp<M>-rank<r>-g<g>.jsonl`` (r its
data-parallel rank, g its global rank: the ranks of one data shard under TP,
PP or CP read the same microbatch, each into its own file); a run's global
batches can then be compared with another run's at another DP size or
layout::

    --override.imports gefen_titan.patches.sdpa_attention.sdpa_attention \
        'gefen_titan.validation.hooks.record_batches={"dir": "/tmp/b"}'
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER, TRAIN_STATE
from torchtitan.components.optimizer.utils import get_flat_optim_state_dict
from torchtitan.config import override
from torchtitan.config.override import derive

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.data.global_loader import GlobalOrderDataLoader
from gefen_titan.distributed import all_gather_objects, local, rank_and_world
from gefen_titan.optim import registry
from gefen_titan.optim.kinds.gefen.per_rank_regions import param_region

__all__ = ["DumpingCheckpointManager", "RecordingGlobalOrderDataLoader", "dump_state", "record_batches", "DUMP_VERSION"]

# Bumped when the dump layout changes (part of a reference run's identity, so
# a reference cache never hands old dumps to a new validator). 3: global-order
# runs also record their batches (``record_batches``). 4: one batch record per
# global rank (TP/PP/CP ranks of a data shard no longer share a file).
# 5: live facts and per-rank pictures by kind (each kind's ``validation``).
DUMP_VERSION = 5


def _region(fqn: str, p: torch.Tensor) -> tuple[int, int]:
    region, _ = param_region(fqn, p)
    return region.start, region.length


class DumpingCheckpointManager(GefenCheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(GefenCheckpointManager.Config):
        dump_dir: str = ""
        """Folder for the dumps (created if missing)."""

        dump_save_steps: list[int] = field(default_factory=list)
        """Steps whose save is followed by a dump (every load is dumped)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._dump_dir = config.dump_dir
        self._dump_save_steps = set(config.dump_save_steps)

    def _load(self, step: int = -1) -> bool:
        begin = time.monotonic()
        loaded = super()._load(step)
        seconds = time.monotonic() - begin
        if loaded:
            train_state = self.states.get(TRAIN_STATE)
            self._dump("load", int(getattr(train_state, "step", step)), seconds)
        return loaded

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        begin = time.monotonic()
        saved = super()._save(curr_step, last_step)
        if saved:
            self.maybe_wait_for_saving()  # async: time the whole write
        seconds = time.monotonic() - begin
        if saved and curr_step in self._dump_save_steps:
            self._dump("save", curr_step, seconds)
        return saved

    # ------------------------------------------------------------------ dump
    def _dump(self, kind: str, step: int, seconds: float) -> None:
        container = self.states.get(OPTIMIZER)
        os.makedirs(self._dump_dir, exist_ok=True)
        if getattr(container, "blocking", None) == "agreed":
            self._dump_global(container, kind, step, seconds)
        else:
            self._dump_rank(container, kind, step, seconds)

    def _model_params(self) -> list[tuple[str, torch.Tensor]]:
        wrapper = self.states.get(MODEL)
        parts = getattr(wrapper, "model", [])
        parts = parts if isinstance(parts, list) else [parts]
        return [(fqn, p) for part in parts for fqn, p in part.named_parameters()]

    # ---------------------------------------------------- agreed: global state
    def _dump_global(self, container: Any, kind: str, step: int, seconds: float) -> None:
        rank, world = rank_and_world()
        sd = _optimizer_entries(container)
        params = self._model_params()
        # The lowest rank of each distinct set of entries writes (pipeline
        # stages hold different ones; everything else has one set: rank 0).
        names = sorted(sd) + ["param:" + n for n, _ in params]
        digest = hashlib.sha1("\n".join(names).encode()).hexdigest()
        everyone = all_gather_objects({"rank": rank, "digest": digest, "seconds": seconds,
                                       "live": _live_facts(container)})
        writer = min(e["rank"] for e in everyone if e["digest"] == digest) == rank
        out: dict[str, Any] = {
            "kind": kind, "step": step, "rank": rank, "world": world, "blocking": "agreed",
            "dump_version": DUMP_VERSION, "seconds": [e["seconds"] for e in everyone],
            "live": [e["live"] for e in everyone],
            "covers": [e["rank"] for e in everyone if e["digest"] == digest],
            "params": {}, "state": {},
        }
        # Collective: every rank of a mesh gathers its entries in the same order.
        for fqn, p in params:
            t = _full(p)
            if writer:
                out["params"][fqn] = t
        for key, value in sd.items():
            if isinstance(value, torch.Tensor):
                t = _full(value)
                if writer:
                    out["state"][key] = t
            elif writer:
                out["state"][key] = value
        if writer:
            torch.save(out, os.path.join(self._dump_dir, f"{kind}-{step}-global-rank{rank}.pt"))

    # ------------------------------------------------- per_rank: this rank only
    def _dump_rank(self, container: Any, kind: str, step: int, seconds: float) -> None:
        rank, world = rank_and_world()
        out: dict[str, Any] = {"kind": kind, "step": step, "rank": rank, "world": world, "seconds": seconds,
                               "blocking": "per_rank", "dump_version": DUMP_VERSION}
        out["params"] = {}
        for fqn, p in self._model_params():
            start, length = _region(fqn, p)
            out["params"][fqn] = {"shape": tuple(p.shape), "start": start, "length": length,
                                  "local": local(p).detach().reshape(-1).float().cpu().clone()}
        out["kinds"] = {spec.name: spec.validation.rank_state(opts) for spec, opts in _validated(container)
                        if spec.validation.rank_state is not None}
        out["other_optim"] = _rank_other_state([o for o in _optimizers(container) if not _pictured(o)])
        torch.save(out, os.path.join(self._dump_dir, f"{kind}-{step}-rank{rank}.pt"))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _optimizers(container: Any) -> list[Any]:
    return [] if container is None else list(container.optimizers)


def _validated(container: Any) -> list[tuple[registry.OptimizerSpec, list[Any]]]:
    """(entry, its optimizers) of every kind with a ``validation`` and optimizers here, in registry order."""
    if container is None:
        return []
    return [(spec, opts) for spec in registry.specs()
            if spec.validation is not None and (opts := container.optimizers_of(spec.name))]


def _pictured(optim: Any) -> bool:
    """Whether the optimizer's kind dumps its own per-rank picture (else its torch state is dumped)."""
    spec = registry.spec_of(optim)
    return spec is not None and spec.validation is not None and spec.validation.rank_state is not None


def _flat(optim: Any) -> bool:
    """Whether the optimizer is checkpointed as torchtitan's flat state dict (no state adapter)."""
    spec = registry.spec_of(optim)
    return spec is None or spec.state is None


def _optimizer_entries(container: Any) -> dict[str, Any]:
    """What a checkpoint of the optimizer holds now: the container's ``state_dict()``.

    Collective (a kind's adapter may check that the ranks agree). Where a
    flat optimizer holds no state yet (its state was not loaded), the
    container would create it with a zero-gradient step; the dump must
    change nothing, so then the entries are built from those flat optimizers
    that hold state plus each kind's adapter's own entries, which is what
    ``state_dict()`` returns less the state it would create.
    """
    if container is None:
        return {}
    flat = [o for o in container.optimizers if _flat(o)]
    if all(o.state for o in flat):
        return container.state_dict()
    sd: dict[str, Any] = {}
    for optim in flat:
        if optim.state:
            sd.update(get_flat_optim_state_dict(optim))
    options = registry.StateOptions(blocking=container.blocking)
    for spec in registry.specs():
        if spec.state is not None and (opts := container.optimizers_of(spec.name)):
            sd.update(spec.state(opts, options).state_dict())
    return sd


def _live_facts(container: Any) -> dict[str, Any]:
    """This rank's live facts, by kind (each kind's ``validation.live_facts``)."""
    return {spec.name: spec.validation.live_facts(opts) for spec, opts in _validated(container)}


def _rank_other_state(optimizers: list[Any]) -> dict[str, dict[str, Any]]:
    """Torch's per-parameter state of these optimizers on this rank, where each local shard lies."""
    out = {}
    for optim in optimizers:
        for group in optim.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for name, p in zip(names, group["params"]):
                st = optim.state.get(p, {})
                if name is None:
                    continue
                start, length = _region(name, p)
                rec: dict[str, Any] = {"shape": tuple(p.shape), "start": start, "length": length}
                for key, value in st.items():
                    if isinstance(value, torch.Tensor) and value.numel() == p.numel():
                        rec[key] = local(value).detach().reshape(-1).float().cpu().clone()
                    elif isinstance(value, torch.Tensor) and value.numel() == 1:
                        rec[key] = float(value)
                out[name] = rec
    return out


@override(
    target=GefenCheckpointManager.Config,
    exact=True,
    description="validate_reshard: dump rank state after loads and chosen saves",
)
def dump_state(cfg: GefenCheckpointManager.Config, *, dir: str, save_steps: list[int] | None = None):
    return derive(cfg, DumpingCheckpointManager.Config, dump_dir=dir, dump_save_steps=list(save_steps or []))


class RecordingGlobalOrderDataLoader(GlobalOrderDataLoader):
    """The global-order loader, writing down which samples each microbatch holds."""

    @dataclass(kw_only=True, slots=True)
    class Config(GlobalOrderDataLoader.Config):
        record_dir: str = ""
        """Folder for ``batches-dp<M>-rank<r>-g<g>.jsonl`` (created if missing)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        os.makedirs(config.record_dir, exist_ok=True)
        # One file per process: two ranks appending to one file (the TP ranks
        # of one data shard) would interleave their lines.
        rank, _ = rank_and_world()
        self._record = os.path.join(config.record_dir,
                                    f"batches-dp{self.dp_world_size}-rank{self.dp_rank}-g{rank}.jsonl")

    def batch_at(self, start: int):
        batch = super().batch_at(start)
        row = {"start": start, "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size,
               "sample_ids": self.rank_sample_ids(start).tolist()}
        with open(self._record, "a") as f:
            f.write(json.dumps(row) + "\n")
        return batch


@override(
    target=GlobalOrderDataLoader.Config,
    exact=True,
    description="record the global sample ids of every microbatch each rank reads",
)
def record_batches(cfg: GlobalOrderDataLoader.Config, *, dir: str):
    return derive(cfg, RecordingGlobalOrderDataLoader.Config, record_dir=dir)
