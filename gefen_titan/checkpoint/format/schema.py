"""The Gefen checkpoint format (``gefen-titan``): its keys, records and checks.

This module is the one definition of the format's keys and tensors (with
``schema_records`` for the records' JSON and the checks of their values,
``schema_v1`` for what only v1 writes and ``schema_muon`` for GefenMuon's
records). Every
writer (the state adapters' saves, ``gefen-titan ckpt convert``) builds its
entries, and every reader (loads, ``ckpt inspect`` / ``verify`` /
``convert``, the reshard validation) parses them, through the functions and
record types here; nothing else formats or parses a record's JSON, slices a
key or knows which tensors a version stores per parameter.
``docs/checkpoint_format.md``'s key tables are generated from ``schema_doc.KEYS``
(each key kind's value and writer, beside the patterns here) and checked by
``tests/unit/test_checkpoint_format_doc.py``.

All keys sit under the optimizer's entry (torchtitan: ``optimizer.``). ``fqn``
is a parameter's canonical name, ``opt`` the first parameter name of the
Gefen optimizer that owns it (unique across pipeline stages).

Version 3 (agreed blocking, the default) and version 2 are mesh-invariant:
the codebook and the periods are the same on every rank, so every tensor is
saved as a DTensor with the parameter's own placements and DCP reshards all
of it at any layout. A load is DCP plus views, nothing is recomputed. Both
store the codes on the parameter's shape; v2 stores the per-block magnitude
and ``vmean`` as two entries on the *block grid* (the shape with the last
dimension divided by the period), v3 as one, the grid with a trailing
dimension of 2 (``pack_blocks``): DCP's metadata holds one chunk record per
entry per rank and frames every stored item, so one entry fewer per
parameter is a third less of both. v3's two state tensors are written as
raw bytes under keys no earlier version wrote (``gefen/qcodes``,
``gefen/grid``); key and length tell a reader how an item is stored
(``is_raw_item``), at no cost to ``.metadata``.

GefenMuon's state (``gefen/muon*``; a checkpoint without GefenMuon holds none
of them; records in ``schema_muon``) has the same keys, framed, in v2 and v3.

Version 1 (per-rank blocking) keeps each rank's own codebook and periods
(``schema_v1``).

The JSON of every record is part of the format: ranks compare the bytes of
the records they write (DCP keeps one copy), so ``to_json`` must stay
byte-for-byte what earlier versions wrote.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from gefen_titan.checkpoint.errors import GefenCheckpointError

__all__ = [
    "FORMAT", "VERSION", "V1", "V2", "VERSIONS", "AGREED_VERSIONS", "PREFIX", "K", "HYPER", "PATTERNS",
    "PARAM_TENSORS", "MUON_TENSORS", "FormatError", "Key",
    "header_key", "optimizer_key", "codebook_key", "codes_key", "qcodes_key", "magnitude_key", "vmean_key",
    "grid_key", "records_key", "blocks_key", "rank_codebook_key", "parse_key", "is_gefen_key", "is_raw_entry",
    "is_raw_item", "param_key_kinds", "param_tensor_keys", "param_tensor_specs", "pack_blocks", "unpack_blocks",
    "grid_shape",
    "muon_optimizer_key",
    "muon_codebook_key", "muon_tensor_keys", "optimizer_id", "SMALL_KINDS", "register_kinds",
    "entry_key",
]

FORMAT = "gefen-titan"
VERSION = 3  # written by agreed blocking
V2 = 2  # agreed blocking before v3: magnitude and vmean as two entries, torch.save framing
V1 = 1  # written by per-rank blocking
VERSIONS = (V1, V2, VERSION)
AGREED_VERSIONS = (V2, VERSION)  # mesh-invariant: loaded by DCP plus views
PREFIX = "gefen/"
K = 256  # codebook entries (gefen-x: num_codebooks=256)

# Group hyperparameters carried in the records and restored on load (torch
# optimizers restore theirs the same way; the LR scheduler then resets lr).
HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")

# The key patterns, by kind (``Key.kind``: the name code uses; the pattern is what is on disk). A
# kind's keys sit under the path segment its row names, not under its name: Gefen's records are kind
# "gefen" (as GefenMuon's are "muon") under the segment "optimizer", which every version (v1 on) has
# written them under. Renaming that segment would be a format step (a new version and a reader of the
# old one), so the row keeps it; ``parse_key`` and ``entry_key`` go through the rows, never through
# the kind's name.
PATTERNS = {
    "header": "gefen/format",
    "gefen": "gefen/optimizer/{opt}",
    "codebook": "gefen/codebook/{opt}",
    "codes": "gefen/codes/{fqn}",
    "qcodes": "gefen/qcodes/{fqn}",
    "magnitude": "gefen/magnitude/{fqn}",
    "vmean": "gefen/vmean/{fqn}",
    "grid": "gefen/grid/{fqn}",
    "muon": "gefen/muon/{opt}",
    "muon_codebook": "gefen/muon_codebook/{opt}",
    "muon_codes": "gefen/muon_codes/{fqn}",
    "muon_magnitude": "gefen/muon_magnitude/{fqn}",
    "muon_rows": "gefen/muon_rows/{fqn}",
    "records": "gefen/records/{opt}/{r}",
    "blocks": "gefen/blocks/{opt}/{r}",
    "rank_codebook": "gefen/codebook/{opt}/{r}",
}

# A stateful agreed parameter's tensors per version, in the order the
# adapters and tools list them.
PARAM_TENSORS = {VERSION: ("codes", "grid"), V2: ("codes", "magnitude", "vmean")}
# Their key kinds (``PATTERNS``): v3's codes have a key of their own, stored raw.
_TENSOR_KINDS = {VERSION: {"codes": "qcodes", "grid": "grid"},
                 V2: {"codes": "codes", "magnitude": "magnitude", "vmean": "vmean"}}
# A GefenMuon parameter's tensors ("rows" only with NorMuon state), v2 and v3.
MUON_TENSORS = ("codes", "magnitude", "rows")

# Stored raw: the chunk's bytes alone (dtype and sizes are the chunk's own in
# .metadata). Only keys that no format before v3 wrote, so no earlier
# checkpoint has a framed item under one of them.
_RAW_KINDS = ("qcodes", "grid")

# The small entries a load reads before DCP reads the state (``gefen_titan.optim.checkpointing.load_context``):
# kind -> "str" (a record's JSON) or "tensor" (a codebook, v1's rank table). Everything else is a
# parameter's state tensor, read by DCP into the load's destinations.
SMALL_KINDS: dict[str, str] = {"header": "str", "gefen": "str", "muon": "str", "codebook": "tensor",
                               "muon_codebook": "tensor", "records": "tensor", "rank_codebook": "tensor"}


def _segment(kind: str) -> str:
    """The path segment of a kind's keys (``gefen/{segment}/...``), from its ``PATTERNS`` row."""
    return PATTERNS[kind][len(PREFIX):].partition("/")[0]


# Kinds keyed by one name (an optimizer id or a fqn), by their keys' segment: ``gefen/{segment}/{name}``
# -> kind (``parse_key``'s map; one segment per kind, one kind per segment).
_NAMED_KINDS: dict[str, str] = {_segment(kind): kind for kind in (
    "gefen", "codebook", "muon", "muon_codebook",
    "codes", "magnitude", "vmean", "qcodes", "grid", "muon_codes", "muon_magnitude", "muon_rows")}


def register_kinds(kinds: dict[str, str]) -> None:
    """The keys of another optimizer kind's state: kind -> "record" (its optimizers' JSON records,
    ``gefen/{kind}/{opt}``), "codebook" (a codebook, ``gefen/{kind}/{opt}``) or "tensor" (a
    parameter's state tensor, ``gefen/{kind}/{fqn}``). A kind's records and codebooks are then read
    with every other kind's in a load's one small read; its tensors are DCP entries like Gefen's.

    A registered kind's segment is its name, so the name must be neither a kind nor the segment of
    one (``optimizer`` is Gefen's records' segment, ``format`` the header's): two kinds under one
    segment would each parse as the other.
    """
    segments = {_segment(k) for k in PATTERNS}
    for kind, role in kinds.items():
        if kind in PATTERNS or role not in ("record", "codebook", "tensor"):
            raise ValueError(f"cannot register key kind {kind!r} as {role!r}: taken, or not record/codebook/tensor")
        if kind in segments or not kind or "/" in kind:
            raise ValueError(f"cannot register key kind {kind!r}: its keys gefen/{kind}/... would be another "
                             "kind's (or no key); name it otherwise")
    for kind, role in kinds.items():
        PATTERNS[kind] = f"{PREFIX}{kind}/{{{'fqn' if role == 'tensor' else 'opt'}}}"
        _NAMED_KINDS[kind] = kind
        if role != "tensor":
            SMALL_KINDS[kind] = "str" if role == "record" else "tensor"


def entry_key(kind: str, name: str) -> str:
    """The key of ``name`` (an optimizer id or a parameter's fqn) of a kind keyed by one name, from the
    kind's ``PATTERNS`` row (``entry_key("gefen", opt)`` is ``gefen/optimizer/{opt}``)."""
    if kind not in _NAMED_KINDS.values():
        raise ValueError(f"{kind!r} is no key kind keyed by one name")
    return PATTERNS[kind].format(opt=name, fqn=name)


def optimizer_id(param_names: list[str] | tuple[str, ...]) -> str:
    """An optimizer's id in the records' keys: its first parameter's name, unique across pipeline
    stages ("" for an optimizer without parameters, which writes no record)."""
    return param_names[0] if param_names else ""


class FormatError(GefenCheckpointError):
    """An entry that does not follow the format: the checkpoint is corrupt, foreign or edited."""


# ------------------------------------------------------------------ keys
def header_key() -> str:
    return PATTERNS["header"]


def optimizer_key(opt: str) -> str:
    """A Gefen optimizer's record (kind ``gefen``)."""
    return PATTERNS["gefen"].format(opt=opt)


def codebook_key(opt: str) -> str:
    """v2/v3: the job's codebook, under each optimizer's id."""
    return PATTERNS["codebook"].format(opt=opt)


def codes_key(fqn: str) -> str:
    """v2 and v1 (v3: ``qcodes_key``)."""
    return PATTERNS["codes"].format(fqn=fqn)


def qcodes_key(fqn: str) -> str:
    """v3: the codes, stored raw."""
    return PATTERNS["qcodes"].format(fqn=fqn)


def magnitude_key(fqn: str) -> str:
    """v2 only."""
    return PATTERNS["magnitude"].format(fqn=fqn)


def vmean_key(fqn: str) -> str:
    """v2 only."""
    return PATTERNS["vmean"].format(fqn=fqn)


def grid_key(fqn: str) -> str:
    """v3: magnitude and vmean in one entry (``pack_blocks``)."""
    return PATTERNS["grid"].format(fqn=fqn)


def muon_optimizer_key(opt: str) -> str:
    return PATTERNS["muon"].format(opt=opt)


def muon_codebook_key(opt: str) -> str:
    """The job's GefenMuon codebook, under each GefenMuon optimizer's id."""
    return PATTERNS["muon_codebook"].format(opt=opt)


def muon_tensor_keys(fqn: str) -> dict[str, str]:
    """A GefenMuon parameter's entries by ``MUON_TENSORS`` name."""
    return {name: PATTERNS["muon_" + name].format(fqn=fqn) for name in MUON_TENSORS}


def records_key(opt: str, rank: int) -> str:
    return PATTERNS["records"].format(opt=opt, r=rank)


def blocks_key(opt: str, rank: int) -> str:
    return PATTERNS["blocks"].format(opt=opt, r=rank)


def rank_codebook_key(opt: str, rank: int) -> str:
    """v1: one codebook per optimizer per source rank."""
    return PATTERNS["rank_codebook"].format(opt=opt, r=rank)


@dataclass(frozen=True)
class Key:
    """A parsed Gefen key: what the entry is, and whose.

    ``kind`` is one of ``header``, ``gefen`` (Gefen's records, keyed
    ``gefen/optimizer/{opt}``), ``codebook`` (v2/v3), ``codes``,
    ``magnitude``, ``vmean`` (v2), ``qcodes``, ``grid`` (v3), ``records``,
    ``blocks``, ``rank_codebook`` (v1), ``muon``, ``muon_codebook``,
    ``muon_codes``, ``muon_magnitude``, ``muon_rows`` (GefenMuon): a
    ``PATTERNS`` row's name, not the key's segment; ``name`` is the
    optimizer id or the parameter's fqn (empty for the header); ``rank``
    the source rank of a v1 entry.
    """

    kind: str
    name: str = ""
    rank: int | None = None


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
    segment, sep, name = rest.partition("/")
    if not sep or not name or "/" in name:
        return None
    kind = _NAMED_KINDS.get(segment)
    return Key(kind, name) if kind is not None else None


def is_gefen_key(key: str) -> bool:
    return key.startswith(PREFIX)


def is_raw_entry(flat_key: str) -> bool:
    """Whether a save writes this DCP entry (flattened: ``optimizer.gefen/grid/...``) as raw bytes."""
    pk = parse_key(flat_key.partition(".")[2])
    return pk is not None and pk.kind in _RAW_KINDS


def is_raw_item(flat_key: str, length: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    """Whether a stored item (its chunk's dtype and sizes) is raw: a raw entry's chunk stored in exactly
    its bytes. A framed item is always longer, so one saved again by DCP's own writer reads as DCP's."""
    return is_raw_entry(flat_key) and int(length) == math.prod(sizes) * torch.empty((), dtype=dtype).element_size()


def param_tensor_keys(fqn: str, version: int = VERSION) -> dict[str, str]:
    """An agreed parameter's entries by ``PARAM_TENSORS[version]`` name."""
    return {name: PATTERNS[_TENSOR_KINDS[version][name]].format(fqn=fqn) for name in PARAM_TENSORS[version]}


def param_key_kinds(version: int) -> tuple[str, ...]:
    """The key kinds of an agreed parameter's entries in ``version`` (v3: qcodes, grid)."""
    return tuple(_TENSOR_KINDS[version].values())


def param_tensor_specs(fqn: str, shape: tuple[int, ...], period: int,
                       version: int = VERSION) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A stateful agreed parameter's entries: key -> (dtype, global shape).

    The codes have the parameter's shape, the per-block tensors its block
    grid (v3: one, with a trailing 2); all shard with the parameter's
    placements (the trailing dimension is never sharded).
    """
    grid = grid_shape(tuple(shape), period)
    keys = param_tensor_keys(fqn, version)
    if version == VERSION:
        return {keys["codes"]: (torch.uint8, tuple(shape)), keys["grid"]: (torch.float32, grid + (2,))}
    return {keys["codes"]: (torch.uint8, tuple(shape)), keys["magnitude"]: (torch.float32, grid),
            keys["vmean"]: (torch.float32, grid)}


def pack_blocks(magnitude: torch.Tensor, vmean: torch.Tensor) -> torch.Tensor:
    """v3's grid entry from a shard's magnitude and vmean (block-grid shaped): a new tensor."""
    return torch.stack((magnitude, vmean), dim=-1)


def unpack_blocks(version: int, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(magnitude, vmean), block-grid shaped, from a parameter's entries by ``PARAM_TENSORS`` name."""
    if version == VERSION:
        grid = tensors["grid"]
        if grid.dim() == 0 or grid.shape[-1] != 2:
            raise FormatError(f"a v3 grid entry has shape {tuple(grid.shape)}, not (..., 2)")
        return grid[..., 0], grid[..., 1]
    return tensors["magnitude"], tensors["vmean"]


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
