"""The Gefen checkpoint format (``gefen-titan``): its keys, records and checks.

This module is the one definition of the format. Every writer (the state
adapters' saves, ``gefen-titan ckpt convert``) builds its entries, and every
reader (loads, ``ckpt inspect`` / ``verify`` / ``convert``, the reshard
validation) parses them, through the functions and record types here;
nothing else formats or parses a record's JSON or slices a key.
``docs/checkpoint_format.md``'s key tables are generated from ``KEYS`` and
checked by ``tests/unit/test_checkpoint_format_doc.py``.

All keys sit under the optimizer's entry (torchtitan: ``optimizer.``). ``fqn``
is a parameter's canonical name, ``opt`` the first parameter name of the
Gefen optimizer that owns it (unique across pipeline stages).

Version 2 (agreed blocking, the default) is mesh-invariant: the codebook and
the periods are the same on every rank, so every tensor is saved as a DTensor
with the parameter's own placements (the codes on the parameter's shape, the
per-block magnitude and ``vmean`` on the *block grid*: the shape with the
last dimension divided by the period) and DCP reshards all of it at any
layout. A load is DCP plus views, nothing is recomputed.

GefenMuon's state is part of v2 (its own records, codebook and tensors,
``gefen/muon*``; a checkpoint without GefenMuon holds none of them): its
records are in ``gefen_titan.checkpoint.schema_muon``.

Version 1 (per-rank blocking) keeps each rank's own codebook and periods;
its loads re-block and requantize where the layout changed
(``gefen_titan.optim.state.per_rank``).

The JSON of every record is part of the format: ranks compare the bytes of
the records they write (DCP keeps one copy), so ``to_json`` must stay
byte-for-byte what earlier versions wrote.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gefen_titan.checkpoint.errors import GefenCheckpointError

__all__ = [
    "FORMAT", "VERSION", "V1", "VERSIONS", "PREFIX", "K", "HYPER", "KEYS", "RECORD_FIELDS", "PARAM_TENSORS",
    "FormatError", "Key", "Header", "ParamRecord", "OptimizerRecord", "V1ParamRecord", "V1OptimizerRecord",
    "V1RankRow", "header_key", "optimizer_key", "codebook_key", "codes_key", "magnitude_key", "vmean_key",
    "records_key", "blocks_key", "rank_codebook_key", "parse_key", "is_gefen_key", "param_tensor_keys",
    "param_tensor_specs", "grid_shape", "check_hyper", "check_codebook", "check_counters", "read_v1_rank_table",
    "v1_rank_table", "key_table", "loads_json", "record_fields", "muon_optimizer_key", "muon_codebook_key",
    "muon_tensor_keys", "MUON_TENSORS", "record_fqns",
]

FORMAT = "gefen-titan"
VERSION = 2  # written by agreed blocking
V1 = 1  # written by per-rank blocking
VERSIONS = (V1, VERSION)
PREFIX = "gefen/"
K = 256  # codebook entries (gefen-x: num_codebooks=256)

# Group hyperparameters carried in the records and restored on load (torch
# optimizers restore theirs the same way; the LR scheduler then resets lr).
HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")

# version -> [(key pattern, value, written by)]; the doc's tables are these rows.
KEYS: dict[int, list[tuple[str, str, str]]] = {
    2: [
        ("gefen/format", 'str (json) {"format": "gefen-titan", "version": 2, "blocking": "agreed"}',
         "every rank (same)"),
        ("gefen/optimizer/{opt}",
         'str (json): "blocking", "deterministic", "global_step", and per parameter in order: '
         '"fqn", "shape", "period" (0: no state yet), "step", "vmean_step", "group" (lr, beta1, '
         "beta2, eps, weight_decay)", "every rank of the optimizer (same)"),
        ("gefen/codebook/{opt}", "fp32 [256], sorted, ends -1 and +1; one codebook for the whole job",
         "every rank of the optimizer (same)"),
        ("gefen/codes/{fqn}", "uint8, the parameter's shape and placements", "DTensor: each its shard"),
        ("gefen/magnitude/{fqn}", "fp32, the block grid (shape[:-1] + (shape[-1] / period,)) with the "
         "parameter's placements", "DTensor: each its shard"),
        ("gefen/vmean/{fqn}", "fp32, the block grid with the parameter's placements", "DTensor: each its shard"),
        ("gefen/muon/{opt}",
         'str (json): "kind" ("GefenMuon"), "blocking", "deterministic", "global_step", and per parameter in '
         'order: "fqn", "shape", "period" (0: no state yet), "step", "rows_step" (NorMuon\'s counter, 0: no '
         'rows), "group" (lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn, '
         "normuon, normuon_beta2, normuon_eps)", "every rank of the optimizer (same)"),
        ("gefen/muon_codebook/{opt}", "fp32 [256], sorted, ends -1 and +1; the GefenMuon optimizers' one codebook "
         "for the whole job", "every rank of the optimizer (same)"),
        ("gefen/muon_codes/{fqn}", "uint8, the GefenMuon parameter's shape and placements", "DTensor: each its shard"),
        ("gefen/muon_magnitude/{fqn}", "fp32, the block grid with the parameter's placements",
         "DTensor: each its shard"),
        ("gefen/muon_rows/{fqn}", "fp32 [rows]: NorMuon's per-row second moment, placed like the parameter's "
         "dim 0 (when rows_step > 0)", "DTensor: each its shard"),
    ],
    1: [
        ("gefen/format", 'str (json) {"format": "gefen-titan", "version": 1} (newer writers add '
         '"blocking": "per_rank")', "every rank (same)"),
        ("gefen/optimizer/{opt}", "str (json): nshards, and per parameter in order: fqn, global shape, "
         "group hyperparameters", "every rank of the optimizer (same)"),
        ("gefen/codes/{fqn}", "uint8, the parameter's global shape and placements", "DTensor: each its shard"),
        ("gefen/records/{opt}/{r}", "int64 [1 + P, 7]: row 0 = global step, P; row 1 + i = parameter i's "
         "start, length, period, step, vmean_step, first block, number of blocks", "rank r"),
        ("gefen/blocks/{opt}/{r}", "fp32 [blocks, 2]: magnitude, vmean, all parameters of the optimizer "
         "back to back", "rank r"),
        ("gefen/codebook/{opt}/{r}", "fp32 [256], sorted, ends -1 and +1", "rank r"),
    ],
}

RECORD_FIELDS = ("start", "length", "period", "step", "vmean_step", "block0", "nblocks")  # v1 rank rows

# A v2 parameter's tensors, in the order the adapters and tools list them.
PARAM_TENSORS = ("codes", "magnitude", "vmean")
# A GefenMuon parameter's tensors ("rows" only with NorMuon state).
MUON_TENSORS = ("codes", "magnitude", "rows")


class FormatError(GefenCheckpointError):
    """An entry that does not follow the format: the checkpoint is corrupt, foreign or edited."""


# ------------------------------------------------------------------ keys
def _key(version: int, index: int, **names: object) -> str:
    return KEYS[version][index][0].format(**names)


def header_key() -> str:
    return _key(2, 0)


def optimizer_key(opt: str) -> str:
    return _key(2, 1, opt=opt)


def codebook_key(opt: str) -> str:
    """v2: the job's codebook, under each optimizer's id."""
    return _key(2, 2, opt=opt)


def codes_key(fqn: str) -> str:
    return _key(2, 3, fqn=fqn)


def magnitude_key(fqn: str) -> str:
    return _key(2, 4, fqn=fqn)


def vmean_key(fqn: str) -> str:
    return _key(2, 5, fqn=fqn)


def muon_optimizer_key(opt: str) -> str:
    return _key(2, 6, opt=opt)


def muon_codebook_key(opt: str) -> str:
    """v2: the job's GefenMuon codebook, under each GefenMuon optimizer's id."""
    return _key(2, 7, opt=opt)


def muon_tensor_keys(fqn: str) -> dict[str, str]:
    """A GefenMuon parameter's entries by ``MUON_TENSORS`` name."""
    return {name: _key(2, 8 + i, fqn=fqn) for i, name in enumerate(MUON_TENSORS)}


def records_key(opt: str, rank: int) -> str:
    return _key(1, 3, opt=opt, r=rank)


def blocks_key(opt: str, rank: int) -> str:
    return _key(1, 4, opt=opt, r=rank)


def rank_codebook_key(opt: str, rank: int) -> str:
    """v1: one codebook per optimizer per source rank."""
    return _key(1, 5, opt=opt, r=rank)


@dataclass(frozen=True)
class Key:
    """A parsed Gefen key: what the entry is, and whose.

    ``kind`` is one of ``header``, ``optimizer``, ``codebook`` (v2),
    ``codes``, ``magnitude``, ``vmean``, ``records``, ``blocks``,
    ``rank_codebook`` (v1), ``muon``, ``muon_codebook``, ``muon_codes``,
    ``muon_magnitude``, ``muon_rows`` (GefenMuon, v2); ``name`` is the optimizer id or the parameter's
    fqn (empty for the header); ``rank`` the source rank of a v1 entry.
    """

    kind: str
    name: str = ""
    rank: int | None = None


_PARAM_KINDS = ("codes", "magnitude", "vmean", "muon_codes", "muon_magnitude", "muon_rows")
_RANK_KEY = re.compile(r"^(records|blocks|codebook)/(.+)/(\d+)$")


def parse_key(key: str) -> Key | None:
    """The ``Key`` of a Gefen entry name (without the ``optimizer.`` prefix); None otherwise.

    Optimizer ids and fqns are dotted names without ``/``, so a trailing
    ``/{r}`` only ever means a v1 rank entry.
    """
    if not key.startswith(PREFIX):
        return None
    rest = key[len(PREFIX):]
    if rest == "format":
        return Key("header")
    m = _RANK_KEY.match(rest)
    if m:
        kind = "rank_codebook" if m.group(1) == "codebook" else m.group(1)
        return Key(kind, m.group(2), int(m.group(3)))
    kind, sep, name = rest.partition("/")
    if not sep or not name or "/" in name:
        return None
    if kind in _PARAM_KINDS or kind in ("optimizer", "codebook", "muon", "muon_codebook"):
        return Key(kind, name)
    return None


def is_gefen_key(key: str) -> bool:
    return key.startswith(PREFIX)


def param_tensor_keys(fqn: str) -> dict[str, str]:
    """A v2 parameter's entries by ``PARAM_TENSORS`` name."""
    return {"codes": codes_key(fqn), "magnitude": magnitude_key(fqn), "vmean": vmean_key(fqn)}


def param_tensor_specs(fqn: str, shape: tuple[int, ...], period: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A stateful v2 parameter's entries: key -> (dtype, global shape).

    The codes have the parameter's shape, the per-block tensors its block
    grid; all shard with the parameter's placements.
    """
    grid = grid_shape(tuple(shape), period)
    keys = param_tensor_keys(fqn)
    return {keys["codes"]: (torch.uint8, tuple(shape)), keys["magnitude"]: (torch.float32, grid),
            keys["vmean"]: (torch.float32, grid)}


def grid_shape(shape: tuple[int, ...], period: int) -> tuple[int, ...]:
    """Shape of a parameter's per-block tensors (magnitude, ``vmean``).

    Blocks run along the last dimension, so the block grid is the parameter's
    shape with the last dimension divided by the period; it shards with the
    parameter's own placements.
    """
    if not shape:
        return ()
    if shape[-1] % period:
        raise ValueError(f"period {period} does not divide the last dimension of shape {tuple(shape)}")
    return tuple(shape[:-1]) + (shape[-1] // period,)


# ------------------------------------------------------------------ records
def loads_json(raw: Any, what: str) -> Any:
    """A record's JSON; FormatError for anything else."""
    if not isinstance(raw, str):
        raise FormatError(f"{what} is {type(raw).__name__}, not a JSON string")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise FormatError(f"{what} is not JSON ({e})") from None


@contextlib.contextmanager
def record_fields(what: str) -> Iterator[None]:
    """Turn a missing or mistyped field of a parsed record into a FormatError."""
    try:
        yield
    except FormatError:
        raise
    except KeyError as e:
        raise FormatError(f"{what} is corrupt (field {e} missing)") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{what} is corrupt ({e})") from None


@dataclass(frozen=True)
class Header:
    """``gefen/format``: the format version and the blocking that wrote it."""

    version: int
    blocking: str | None  # "agreed" (v2) | "per_rank" (v1; absent in early v1 writers)

    @classmethod
    def for_blocking(cls, blocking: str) -> Header:
        return cls(VERSION, "agreed") if blocking == "agreed" else cls(V1, "per_rank")

    @property
    def implied_blocking(self) -> str:
        return "agreed" if self.version == VERSION else "per_rank"

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": self.version, "blocking": self.blocking})

    @classmethod
    def from_json(cls, raw: Any) -> Header:
        """Raises FormatError for anything but a gefen-titan v1 or v2 header."""
        data = loads_json(raw, f"the Gefen header {header_key()}")
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") not in VERSIONS:
            raise FormatError(
                f"checkpoint format {data} is not {FORMAT} v{V1} or v{VERSION}; it was written by another "
                "gefen-titan version. Load it with that version or exclude the optimizer")
        return cls(int(data["version"]), data.get("blocking"))


def _group(raw: dict[str, Any]) -> dict[str, float]:
    return {k: float(raw[k]) for k in HYPER}


@dataclass
class ParamRecord:
    """v2: one parameter's period, counters and group hyperparameters."""

    fqn: str
    shape: tuple[int, ...]
    period: int  # 0: no state yet
    step: int
    vmean_step: int
    group: dict[str, float]

    @property
    def grid(self) -> tuple[int, ...] | None:
        return grid_shape(self.shape, self.period) if self.period else None

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "shape": list(self.shape), "period": self.period, "step": self.step,
                "vmean_step": self.vmean_step, "group": {k: float(self.group[k]) for k in HYPER}}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ParamRecord:
        # The group is kept as saved: check_hyper says what is wrong with it.
        return cls(str(raw["fqn"]), tuple(int(s) for s in raw["shape"]), int(raw["period"]), int(raw["step"]),
                   int(raw["vmean_step"]), dict(raw["group"]))


@dataclass
class OptimizerRecord:
    """v2: ``gefen/optimizer/{opt}``, one Gefen optimizer's parameters in order."""

    deterministic: bool
    global_step: int
    params: list[ParamRecord] = field(default_factory=list)
    blocking: str = "agreed"

    def to_json(self) -> str:
        return json.dumps({"blocking": self.blocking, "deterministic": self.deterministic,
                           "global_step": self.global_step, "params": [p.to_dict() for p in self.params]},
                          sort_keys=True)

    @classmethod
    def from_json(cls, raw: Any, opt: str) -> OptimizerRecord:
        what = f"optimizer record {opt}"
        data = loads_json(raw, what)
        with record_fields(what):
            if data.get("blocking") != "agreed":
                raise FormatError(f"{what} is not an agreed-blocking record")
            return cls(bool(data["deterministic"]), int(data["global_step"]),
                       [ParamRecord.from_dict(p) for p in data["params"]])


@dataclass
class V1ParamRecord:
    """v1: a parameter's global shape and group hyperparameters."""

    fqn: str
    shape: tuple[int, ...]
    group: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "shape": list(self.shape), "group": {k: float(self.group[k]) for k in HYPER}}


@dataclass
class V1OptimizerRecord:
    """v1: ``gefen/optimizer/{opt}``, the optimizer's source ranks and parameters."""

    nshards: int
    params: list[V1ParamRecord]

    def to_json(self) -> str:
        return json.dumps({"nshards": self.nshards, "params": [p.to_dict() for p in self.params]}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: Any, opt: str) -> V1OptimizerRecord:
        what = f"optimizer record {opt}"
        data = loads_json(raw, what)
        with record_fields(what):
            return cls(int(data["nshards"]), [V1ParamRecord(str(p["fqn"]), tuple(int(s) for s in p["shape"]),
                                                            dict(p["group"])) for p in data["params"]])


@dataclass(frozen=True)
class V1RankRow:
    """v1: where a source rank's state of one parameter lies (``RECORD_FIELDS``)."""

    start: int
    length: int
    period: int
    step: int
    vmean_step: int
    block0: int
    nblocks: int

    @property
    def stop(self) -> int:
        return self.start + self.length

    def check(self, fqn: str, label: int, block_rows: int) -> str | None:
        """Why the row cannot describe ``block_rows`` saved blocks, or None."""
        p = self.period
        if (p < 0 or (p and (self.length % p or self.nblocks != self.length // p)) or (not p and self.nblocks)
                or self.block0 < 0 or self.block0 + self.nblocks > block_rows):
            return (f"{fqn}: source rank {label} has inconsistent blocks (length {self.length}, period {p}, "
                    f"blocks {self.block0}+{self.nblocks} of {block_rows})")
        return None


def v1_rank_table(global_step: int, rows: list[V1RankRow]) -> torch.Tensor:
    """``gefen/records/{opt}/{r}``: row 0 = (global step, P), then one row per parameter."""
    table = [[global_step, len(rows), 0, 0, 0, 0, 0]]
    table += [[getattr(r, f) for f in RECORD_FIELDS] for r in rows]
    return torch.tensor(table, dtype=torch.int64)


def read_v1_rank_table(table: torch.Tensor, nparams: int, what: str) -> tuple[int, list[V1RankRow]]:
    """(global step, rows) of a v1 rank table that must describe ``nparams`` parameters."""
    if tuple(table.shape) != (1 + nparams, len(RECORD_FIELDS)):
        raise FormatError(f"{what} has shape {tuple(table.shape)}, expected {(1 + nparams, len(RECORD_FIELDS))}")
    values = table.tolist()
    return int(values[0][0]), [V1RankRow(*(int(x) for x in row)) for row in values[1:]]


def record_fqns(raw: Any, what: str) -> list[str]:
    """The parameter names of an optimizer record of any kind and version
    (``gefen/optimizer/{opt}`` v1 or v2, ``gefen/muon/{opt}``): which
    optimizer kind saved each parameter."""
    data = loads_json(raw, what)
    with record_fields(what):
        return [str(p["fqn"]) for p in data["params"]]


# ------------------------------------------------------------------ checks
def check_hyper(fqn: str, group: dict[str, Any]) -> None:
    """Group hyperparameters that Gefen can represent (else FormatError)."""
    for k in HYPER:
        v = group.get(k)
        if not isinstance(v, (int, float)) or not (v == v) or v < 0:
            raise FormatError(f"{fqn}: hyperparameter {k}={v!r} in the checkpoint is invalid")
    if not (group["beta1"] < 1 and group["beta2"] < 1 and group["eps"] > 0):
        raise FormatError(f"{fqn}: checkpoint hyperparameters {group} cannot be represented by Gefen")


def check_codebook(cb: torch.Tensor, what: str) -> torch.Tensor:
    """Gefen's load validation: fp32 [256], finite, sorted, ends exactly -1 and +1."""
    cb = cb.float()
    if cb.numel() != K or not torch.isfinite(cb).all() or cb[0] != -1 or cb[-1] != 1 or (cb[1:] < cb[:-1]).any():
        raise FormatError(f"{what} is corrupt (must be {K} sorted finite values from -1 to 1)")
    return cb


def check_counters(fqn: str, period: int, step: int, vmean_step: int, global_step: int | None = None) -> str | None:
    """Why a parameter's period and counters cannot be Gefen's, or None."""
    if period < 0 or step < 0 or vmean_step < 0 or vmean_step > step or (period == 0) != (step == 0):
        return f"{fqn}: counters do not add up (period {period}, step {step}, vmean_step {vmean_step})"
    if global_step is not None and step > global_step:
        return f"{fqn}: global step {global_step} < parameter step {step}"
    return None


# ------------------------------------------------------------------ docs
def key_table(version: int) -> str:
    """The markdown key table of a version, as ``docs/checkpoint_format.md`` shows it."""
    rows = ["| key | value | written by |", "|---|---|---|"]
    rows += [f"| `{key}` | {value} | {by} |" for key, value, by in KEYS[version]]
    return "\n".join(rows)
