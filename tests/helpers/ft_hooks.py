"""Dumps for the fault-tolerance tests: what a heal sent and loaded, and each rank's state at the end.

A torchtitan override that swaps the FT recipe's ``GefenFTCheckpointManager``
for a subclass which writes, with ``torch.save``, into ``dir``:

* ``sent-g<replica>-r<rank>-s<step>.pt``: the payload a live group's rank
  handed torchft for a joiner (the heal payload, as captured);
* ``healed-g<replica>-r<rank>-s<step>.pt``: the joiner rank's live state
  captured again right after the heal loaded (before its first step);
* ``saved-g<replica>-r<rank>-s<step>.pt``: the live state a persistent
  checkpoint of that step was written from (only the writing group);
* ``end-g<replica>-r<rank>.pt``: the rank's live state after the last step.

``<step>`` is the trainer step the payload carries. ``fail_heals`` makes a
live rank's first heals (after step 1) fail, to test that a heal that fails
midway is retried; ``tamper_heals`` changes them on the wire after the
transport signed them, to test that a keyed joiner refuses them and heals
again. Comparing ``healed``
with the matching ``sent`` checks that a heal leaves the joiner exactly at
its peer; comparing the ``end`` files of two groups (and of two runs) checks
lockstep and the uninterrupted run. Used as::

    --override.imports gefen_titan.patches.sdpa_attention.sdpa_attention \
        'tests.helpers.ft_hooks.dump_ft={"dir": "/tmp/d"}'
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.config import override
from torchtitan.config.override import derive

from gefen_titan.ft.checkpoint import HEAL_KEY, GefenFTCheckpointManager


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return copy.deepcopy(value)


class DumpingFTCheckpointManager(GefenFTCheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(GefenFTCheckpointManager.Config):
        dump_dir: str = ""
        fail_heals: int = 0
        """The first this many heals this rank serves after step 1 raise instead (a peer that fails
        during a heal: torchft reports it, no group commits the step, the next quorum heals again)."""
        tamper_heals: int = 0
        """The first this many heals this rank serves after step 1 are changed after the transport
        signed them (one model element + 1, on the wire): with a key the joiner must refuse them."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self._dump_dir = config.dump_dir
        self._fail_heals = config.fail_heals
        self._tamper_heals = config.tamper_heals
        super().__init__(config, **kwargs)
        if config.tamper_heals:
            self._tamper(kwargs["ft_manager"].transport)
        os.makedirs(self._dump_dir, exist_ok=True)
        replica = kwargs["ft_manager"].replica_id
        self._tag = f"g{replica}-r{dist.get_rank()}"
        heal = self.heal
        send, load = heal.state_dict, heal.load_state_dict

        def sent() -> dict[str, Any]:
            payload = send()
            if payload["train_state"]["step"] > 1 and self._fail_heals > 0:
                self._fail_heals -= 1
                raise RuntimeError("injected: the live peer failed while serving a heal")
            self._write(f"sent-{self._tag}-s{payload['train_state']['step']}.pt", payload)
            return payload

        def loaded(state_dict: dict[str, Any]) -> None:
            load(state_dict)
            self._write(f"healed-{self._tag}-s{state_dict['train_state']['step']}.pt", send())

        # torchft keeps the functions registered in __init__: swap them in its tables.
        ft = self.ft_manager
        key = next(k for k in ft._user_state_dicts)
        ft._user_state_dicts[key] = sent
        ft._load_state_dict_fns[key] = loaded

    def _tamper(self, transport: Any) -> None:
        """Once the transport has signed and staged a heal, and before it serves it, swap in a copy with
        one model element changed (torchft's HTTPTransport stages ``_state_dict`` and then serves it
        from ``allow_checkpoint`` on; the live tensors stay as they are)."""
        allow = transport.allow_checkpoint

        def tampered(step: int) -> None:
            if step > 1 and self._tamper_heals > 0:
                self._tamper_heals -= 1
                served = transport._state_dict
                heal = dict(served["user"][HEAL_KEY])
                model = dict(heal["model"])
                name = sorted(model)[0]
                model[name] = model[name].clone()
                model[name].view(-1)[0] += 1
                heal["model"] = model
                transport._state_dict = {**served, "user": {**served["user"], HEAL_KEY: heal}}
                print(f"injected: heal for step {step} changed after it was signed", flush=True)
            allow(step)

        transport.allow_checkpoint = tampered

    def _write(self, name: str, payload: dict[str, Any]) -> None:
        torch.save(_cpu(payload), os.path.join(self._dump_dir, name))

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        out = super()._save(curr_step, last_step)
        if out:  # the persistent checkpoint this rank just wrote, as live state
            self._write(f"saved-{self._tag}-s{curr_step}.pt", self.heal.state_dict())
        if last_step and self.heal.optimizers.last_step_committed:
            self._write(f"end-{self._tag}.pt", self.heal.state_dict())
        return out


@override(target=GefenFTCheckpointManager.Config, exact=True,
          description="tests: dump heal payloads and end states")
def dump_ft(cfg: GefenFTCheckpointManager.Config, *, dir: str, fail_heals: int = 0, tamper_heals: int = 0):
    return derive(cfg, DumpingFTCheckpointManager.Config, dump_dir=dir, fail_heals=fail_heals,
                  tamper_heals=tamper_heals)
