"""The checks ``ckpt verify`` makes of one stored item once its bytes are read.

Part of ``ckpt_tools.verify`` (its second pass, every byte): what is
checked of an item's bytes and value, apart from the pass that reads them.
An item runs the load's entry stage (``load_checks.read_byte_entry``: the
allowlists, a data loader's inner pickle, the step binding, the byte
entries' values; ``load_checks.stored_tensor_problem``) exactly as the
resume reads it, the zip's own CRC32 of a ``torch.save`` record, and the
value checks: the entries each kind's description names ``nonnegative``
by the load's own function (``kinds.nonnegative_problem``), every other
floating value finite. ``nonnegative_entry`` is shared with ``export``,
which refuses what the load would.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from torchtitan.components.checkpoint import OPTIMIZER

from gefen_titan.checkpoint.checks import entry_values, load_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.checkpoint.format import kinds, schema, unpickling
from gefen_titan.ckpt_tools.view import Checkpoint, split_state_key

__all__ = ["ItemChecks", "nonnegative_entry"]


def nonnegative_entry(component: str, name: str) -> bool:
    """Whether entry ``name`` of ``component`` holds values that are finite and >= 0 in any state its kind
    makes (the kinds' ``nonnegative``, which the load refuses otherwise; torch's second moments): ``verify``,
    ``export`` and ``convert`` check them with the load's function (``kinds.nonnegative_problem``)."""
    if component != OPTIMIZER:
        return False
    key = schema.parse_key(name)
    if key is not None and any(key.kind in d.nonnegative for d in kinds.descriptions()):
        return True
    split = split_state_key(name)
    return bool(split and split[1] in ("exp_avg_sq", "max_exp_avg_sq"))


class ItemChecks:
    """One verify run's item checks: each problem goes to ``add(file, entry, what, check)`` (``check``: its
    name in ``load_checks.CHECKS``, None for one of verify's own), and ``checked["crc_checked"]`` counts
    the records whose CRC32s were checked. ``path``: the checkpoint, as the refusals name it."""

    def __init__(self, path: str, add: Callable[..., None], checked: dict[str, int]) -> None:
        self.path = path
        self.add = add
        self.checked = checked

    def check(self, ck: Checkpoint, name: str, index: Any, data: bytes, raw: bool = False) -> None:
        """One stored item's checks; ``raw``: format v3's raw bytes (``schema.is_raw_entry``)."""
        e = ck.entries.get(index.fqn)
        if e is None:
            return
        if raw and not e.is_tensor:
            self.add(name, e.key, "a raw stored item of an entry that is no tensor")
            return
        if not raw and data[:2] == b"PK":
            try:
                unpickling.check_archive(io.BytesIO(data), f"entry {e.key}", self.path)  # before testzip inflates
            except GefenCheckpointError as err:
                self.add(name, e.key, str(err), err.check)
                return
            try:
                bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
            except (zipfile.BadZipFile, ValueError, EOFError, OSError) as err:
                self.add(name, e.key, f"unreadable stored record ({err})")
                return
            self.checked["crc_checked"] += 1
            if bad is not None:
                self.add(name, e.key, f"corrupt bytes: CRC32 mismatch in its record ({bad})")
                return
        elif not e.is_tensor:
            self.add(name, e.key, "unreadable stored object (not a torch.save record)")
            return
        if not e.is_tensor:
            try:
                load_checks.read_byte_entry(io.BytesIO(data), e.key, self.path)  # as a resume reads it
            except unpickling.ForbiddenObjectError as err:
                check = "loader states" if load_checks.is_loader_state(e.key) else "byte entries"
                self.add(name, e.key, f"refused: names {err.name}, which a checkpoint may not hold (reading it "
                                      "could run code)", check)
            except load_checks.StepMismatchError as err:
                self.add(name, e.key, str(err), "step binding")
            except entry_values.EntryValueError as err:  # a type or range no save writes: what the resume refuses
                self.add(name, e.key, str(err), err.check)
            except Exception as err:
                self.add(name, e.key, f"stored object does not load ({type(err).__name__}: {err})", "byte entries")
            return
        sizes = next((s for o, s in e.chunks if index.offset is not None and o == tuple(index.offset)), None)
        if sizes is None:
            self.add(".metadata", e.key, f"stored item at {tuple(index.offset or ())} is no chunk of the entry")
            return
        try:
            if not raw and data[:2] == b"PK":
                t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            else:  # raw bytes (v3's, or DCP's non-torch.save serialization)
                t = torch.frombuffer(bytearray(data), dtype=e.dtype).reshape(sizes) if data else \
                    torch.empty(sizes, dtype=e.dtype)
        except Exception as err:
            self.add(name, e.key, f"stored tensor does not load ({type(err).__name__}: {err})")
            return
        why = load_checks.stored_tensor_problem(e.key, t, e.dtype, tuple(sizes))
        if why:
            self.add(name, e.key, why, "stored tensors")
            return
        if t.is_floating_point() and t.numel():
            if nonnegative_entry(e.component, e.name):  # the load's own check (its adapters')
                why = kinds.nonnegative_problem(t)
                if why:
                    self.add(name, e.key, f"a magnitude or second moment with {why} (the resume refuses it)")
                return
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                self.add(name, e.key, f"{bad:,} non-finite value(s) of {t.numel():,}")
