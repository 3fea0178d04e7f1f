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

``<step>`` is the trainer step the payload carries. ``tamper_heals``
changes a live rank's first heals (after step 1) on the wire after the
transport signed them, to test that a keyed joiner refuses them and heals
again; ``die_serving_heal`` (a byte count) makes the first live rank of the
run (one process in all, by a marker file ``died-mid-heal`` in ``dir``)
that streams a heal after step 1 SIGKILL itself once that many bytes went
out: a serving peer that dies mid-transfer. Comparing ``healed``
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
        tamper_heals: int = 0
        """The first this many heals this rank serves after step 1 are changed after the transport
        signed them (one model element + 1, on the wire): with a key the joiner must refuse them."""
        die_serving_heal: int = 0
        """Bytes: the run's first heal served after step 1 kills its server's process (SIGKILL, no
        exception) once this many bytes of it went out (module docstring). 0: off."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self._dump_dir = config.dump_dir
        self._tamper_heals = config.tamper_heals
        super().__init__(config, **kwargs)
        if config.tamper_heals:
            self._tamper(kwargs["ft_manager"].transport)
        os.makedirs(self._dump_dir, exist_ok=True)
        replica = kwargs["ft_manager"].replica_id
        self._tag = f"g{replica}-r{dist.get_rank()}"
        if config.die_serving_heal:
            self._die_serving(config.die_serving_heal)
        heal = self.heal
        send, settle = heal.state_dict, heal.after_quorum

        def sent() -> dict[str, Any]:
            payload = send()
            self._write(f"sent-{self._tag}-s{payload['train_state']['step']}.pt", payload)
            return payload

        def settled() -> None:  # a heal is installed here, on every rank of the group or none (ft.heal)
            heals = heal.stats.heals
            settle()
            if heal.stats.heals > heals:
                self._write(f"healed-{self._tag}-s{heal.train_state.step}.pt", send())

        # torchft keeps the functions registered in __init__: swap them in its tables.
        ft = self.ft_manager
        key = next(k for k in ft._user_state_dicts)
        ft._user_state_dicts[key] = sent
        heal.after_quorum = settled  # the container calls it on the object it holds

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

    def _die_serving(self, cut: int) -> None:
        """Serve the run's first heal after step 1 through a stream that SIGKILLs this process after
        ``cut`` bytes (torchft's HTTP server streams the staged payload with ``_streaming_save``)."""
        import torchft.checkpointing.http_transport as http_transport

        from tests.helpers.dying_heal_server import DyingStream

        save, marker = http_transport._streaming_save, os.path.join(self._dump_dir, "died-mid-heal")

        def streaming_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            user = obj.get("user", {}) if isinstance(obj, dict) else {}
            step = user.get(HEAL_KEY, {}).get("train_state", {}).get("step", 0)
            if step > 1:
                try:  # the first server of the run, and only it
                    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return save(obj, f, *args, **kwargs)
                os.write(fd, f"{self._tag} s{step}".encode())
                os.close(fd)
                print(f"injected: {self._tag} dies after {cut} bytes of the heal for step {step}", flush=True)
                f = DyingStream(f, cut)
            return save(obj, f, *args, **kwargs)

        http_transport._streaming_save = streaming_save

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
def dump_ft(cfg: GefenFTCheckpointManager.Config, *, dir: str, tamper_heals: int = 0, die_serving_heal: int = 0):
    return derive(cfg, DumpingFTCheckpointManager.Config, dump_dir=dir, tamper_heals=tamper_heals,
                  die_serving_heal=die_serving_heal)
