"""Opt-in hooks for ``scripts/validate_reshard.py`` and the resume tests.

``dump_state``: dump state around checkpoints.

A torchtitan config override (``torchtitan.config.override``) that swaps the
recipe's ``GefenCheckpointManager`` for a subclass which, after a successful
load and after the saves of chosen steps, writes this rank's raw training
state to ``<dir>/<kind>-<step>-rank<r>.pt``:

* every parameter's local shard (and where it lies in the flattened
  parameter),
* every Gefen parameter's state exactly as the optimizer holds it (uint8
  codes, per-block magnitude and ``vmean``, period, step counters) plus each
  Gefen optimizer's codebook and global step,
* the tensors of any other optimizer's state (AdamW groups of mixed recipes),
* the wall time of the save or load (DCP call included, the dump excluded).

Nothing is active unless a run lists it, e.g.::

    --override.imports '["gefen_titan.patches.sdpa_attention.sdpa_attention",
                         ["gefen_titan.validate_hooks.dump_state", {"dir": "/tmp/d", "save_steps": [4]}]]'

It reads the live objects only; training, saving and loading are torchtitan's
and ``GefenCheckpointManager``'s, unchanged.

``record_batches``: with the global-order loader, every rank appends, for each
microbatch it reads, the stream position and the global sample ids to
``<dir>/batches-dp<M>-rank<r>.jsonl``; a run's global batches can then be
compared with another run's at another DP size::

    --override.imports '["gefen_titan.patches.sdpa_attention.sdpa_attention",
                         ["gefen_titan.validate_hooks.record_batches", {dir = "/tmp/b"}]]'
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER, TRAIN_STATE
from torchtitan.config import override
from torchtitan.config.override import derive

from .checkpoint import GefenCheckpointManager
from .global_dataloader import GlobalOrderDataLoader

__all__ = ["DumpingCheckpointManager", "RecordingGlobalOrderDataLoader", "dump_state", "record_batches"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _region(fqn: str, p: torch.Tensor) -> tuple[int, int]:
    from .reshard.layout import param_region

    region, _ = param_region(fqn, p)
    return region.start, region.length


class DumpingCheckpointManager(GefenCheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(GefenCheckpointManager.Config):
        dump_dir: str = ""
        """Folder for the per-rank dumps (created if missing)."""

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
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        out: dict[str, Any] = {"kind": kind, "step": step, "rank": rank, "world": world, "seconds": seconds}
        out["params"] = self._params()
        container = self.states.get(OPTIMIZER)
        out["gefen"], out["codebooks"] = self._gefen_state(container)
        out["other_optim"] = self._other_state(container)
        os.makedirs(self._dump_dir, exist_ok=True)
        torch.save(out, os.path.join(self._dump_dir, f"{kind}-{step}-rank{rank}.pt"))

    def _params(self) -> dict[str, dict[str, Any]]:
        wrapper = self.states.get(MODEL)
        parts = getattr(wrapper, "model", [])
        parts = parts if isinstance(parts, list) else [parts]
        out = {}
        for part in parts:
            for fqn, p in part.named_parameters():
                start, length = _region(fqn, p)
                out[fqn] = {"shape": tuple(p.shape), "start": start, "length": length,
                            "local": _local(p).detach().reshape(-1).float().cpu().clone()}
        return out

    @staticmethod
    def _gefen_state(container: Any) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        adapter = getattr(container, "_gefen_state", None)
        if adapter is None:
            return {}, {}
        state, codebooks = {}, {}
        for slot in adapter.slots:
            st = slot.optim.state.get(slot.param, {})
            rec: dict[str, Any] = {"shape": tuple(slot.param.shape), "start": slot.region.start,
                                   "length": slot.region.length, "optimizer": slot.opt_id,
                                   "hyper": {k: float(slot.group[k]) for k in ("lr", "beta1", "beta2", "eps")}}
            if "m_codebook" in st:
                rec.update(
                    period=int(st["automatic_period"]), step=int(st["step"]),
                    vmean_step=int(st.get("vmean_step", st["step"])),
                    codes=st["m_codebook"].reshape(-1).cpu().clone(),
                    magnitude=st["m_magnitude"].reshape(-1).float().cpu().clone(),
                    vmean=st["vmean"].reshape(-1).float().cpu().clone(),
                )
            state[slot.fqn] = rec
            cb = getattr(slot.optim, "_gefen_codebook", None)
            if slot.opt_id not in codebooks:
                codebooks[slot.opt_id] = {
                    "codebook": None if cb is None else cb.detach().float().cpu().clone(),
                    "global_step": int(getattr(slot.optim, "_gefen_global_step", 0)),
                }
        return state, codebooks

    @staticmethod
    def _other_state(container: Any) -> dict[str, dict[str, Any]]:
        if container is None or not hasattr(container, "_other_optimizers"):
            return {}
        out = {}
        for optim in container._other_optimizers():
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
                            rec[key] = _local(value).detach().reshape(-1).float().cpu().clone()
                        elif isinstance(value, torch.Tensor) and value.numel() == 1:
                            rec[key] = float(value)
                    out[name] = rec
        return out


@override(
    target=GefenCheckpointManager.Config,
    exact=True,
    description="validate_reshard: dump rank state after loads and chosen saves",
)
def dump_state(cfg: GefenCheckpointManager.Config, *, dir: str, save_steps: list[int] | None = None):  # noqa: A002
    return derive(cfg, DumpingCheckpointManager.Config, dump_dir=dir, dump_save_steps=list(save_steps or []))


class RecordingGlobalOrderDataLoader(GlobalOrderDataLoader):
    """The global-order loader, writing down which samples each microbatch holds."""

    @dataclass(kw_only=True, slots=True)
    class Config(GlobalOrderDataLoader.Config):
        record_dir: str = ""
        """Folder for ``batches-dp<M>-rank<r>.jsonl`` (created if missing)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        os.makedirs(config.record_dir, exist_ok=True)
        self._record = os.path.join(config.record_dir, f"batches-dp{self.dp_world_size}-rank{self.dp_rank}.jsonl")

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
def record_batches(cfg: GlobalOrderDataLoader.Config, *, dir: str):  # noqa: A002
    return derive(cfg, RecordingGlobalOrderDataLoader.Config, record_dir=dir)
