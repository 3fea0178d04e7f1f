"""The Gefen checkpoint format (``gefen-titan``): its versions, its key grammar and the parsing of a key.

This module defines what every key of the format is made of, and names no
optimizer kind: a kind's keys are rows (``KeyRow``: the key kind, its
pattern on disk, whether the load reads it in its one small read, whether it
is stored raw) that the kind's own files declare
(``gefen_titan.optim.kinds.gefen.keys``, ``...gefen_muon.keys``) and its
checkpoint description carries (``kinds.KindDescription.key_rows``), and
``kinds.register`` registers them here. Every writer and reader formats and
parses a key through these rows (``entry_key``, ``parse_key``, the kinds'
key functions built on ``KeyRow.key``); nothing else slices a key.
``docs/checkpoint_format.md``'s key tables are generated from the rows'
documentation (``schema_doc``) and checked by
``tests/unit/test_checkpoint_format_doc.py``.

All keys sit under the optimizer's entry (torchtitan: ``optimizer.``) and under
``gefen/``. A row's pattern is ``gefen/{segment}/{opt}`` (an optimizer's
record or codebook: ``opt`` is the first parameter name of the optimizer that
owns it, unique across pipeline stages), ``gefen/{segment}/{fqn}`` (a
parameter's state tensor: ``fqn`` its canonical name) or
``gefen/{segment}/{opt}/{r}`` (v1: one per source rank ``r``). A key kind is
named in code; its segment is what is on disk, and renaming a segment is a
format step (a new version and a reader of the old one). ``gefen/format`` is
the header, the one row defined here.

Version 4 (agreed blocking, the default), 3 and 2 are mesh-invariant:
the codebook and the periods are the same on every rank, so every tensor is
saved as a DTensor with the parameter's own placements and DCP reshards all
of it at any layout. A load is DCP plus views, nothing is recomputed. v3
writes some state tensors as raw bytes (``KeyRow.raw``: only under keys no
earlier version wrote); key and length tell a reader how an item is stored
(``is_raw_item``), at no cost to ``.metadata``. Version 1 (per-rank blocking)
keeps each rank's own codebook and periods. v4 is v3 plus what a kind
may store of a parameter beside it (Gefen's factored second moment: its
rows and columns, placed like the parameter's); a record says which.

The JSON of every record is part of the format: ranks compare the bytes of
the records they write (DCP keeps one copy), so each kind's ``to_json`` must
stay byte-for-byte what earlier versions wrote.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gefen_titan.checkpoint.errors import GefenCheckpointError

__all__ = [
    "FORMAT", "VERSION", "V1", "V2", "V3", "VERSIONS", "AGREED_VERSIONS", "PREFIX", "K", "PATTERNS", "SMALL_KINDS",
    "FormatError", "Key", "KeyRow", "HEADER", "register_rows", "unregister_rows", "header_key", "parse_key",
    "is_gefen_key", "is_raw_entry", "is_raw_item", "optimizer_id", "entry_key", "grid_shape",
]

FORMAT = "gefen-titan"
VERSION = 4  # written by agreed blocking: v3 plus the factored second moment's entries
V3 = 3  # agreed blocking before v4: every parameter's second moment a block vmean
V2 = 2  # agreed blocking before v3: magnitude and vmean as two entries, torch.save framing
V1 = 1  # written by per-rank blocking
VERSIONS = (V1, V2, V3, VERSION)
AGREED_VERSIONS = (V2, V3, VERSION)  # mesh-invariant: loaded by DCP plus views
PREFIX = "gefen/"
K = 256  # codebook entries (gefen-x: num_codebooks=256)


@dataclass(frozen=True)
class KeyRow:
    """One key kind of the format: the name code uses (``Key.kind``), its pattern on disk, and how it is read.

    ``pattern``: ``gefen/{segment}/{opt}``, ``gefen/{segment}/{fqn}`` or ``gefen/{segment}/{opt}/{r}``.
    ``small``: ``"str"`` (a record's JSON) or ``"tensor"`` (a codebook, v1's rank table) for the entries a
    load reads in its one small read before DCP reads the state (``SMALL_KINDS``); None for a parameter's
    state tensor, read by DCP into the load's destinations. ``raw``: stored as the chunk's bytes alone,
    never framed; only a row whose keys no format before v3 wrote, so that no earlier checkpoint has a
    framed item under one of them.
    """

    kind: str
    pattern: str
    small: str | None = None
    raw: bool = False

    @property
    def segment(self) -> str:
        return self.pattern[len(PREFIX):].partition("/")[0]

    @property
    def ranked(self) -> bool:
        return self.pattern.endswith("/{r}")

    def key(self, name: str, rank: int | None = None) -> str:
        """The key of ``name`` (an optimizer id or a fqn; ``rank``: a v1 row's source rank)."""
        return self.pattern.format(opt=name, fqn=name, r=rank)


HEADER = KeyRow("header", "gefen/format", small="str")

# Every registered row's pattern and small read, by key kind (the header's, then the kinds' in registration order).
PATTERNS: dict[str, str] = {HEADER.kind: HEADER.pattern}
SMALL_KINDS: dict[str, str] = {HEADER.kind: "str"}
_ROWS: dict[str, KeyRow] = {HEADER.kind: HEADER}
# segment -> key kind, for keys ``gefen/{segment}/{name}`` and (v1) ``gefen/{segment}/{name}/{r}``: one kind
# per segment and shape, so ``parse_key`` is a lookup.
_NAMED: dict[str, str] = {}
_RANKED: dict[str, str] = {}
_SHAPES = (re.compile(r"^gefen/([a-z0-9_]+)/\{(opt|fqn)\}$"), re.compile(r"^gefen/([a-z0-9_]+)/\{opt\}/\{r\}$"))


def _refusal(row: KeyRow) -> str | None:
    """Why a row cannot be registered beside the rows registered now (None: it can)."""
    if row.kind in _ROWS:
        return f"key kind {row.kind!r} is taken"
    if row.small not in (None, "str", "tensor"):
        return f"key kind {row.kind!r}: small must be None, 'str' or 'tensor', not {row.small!r}"
    named, ranked = _SHAPES[0].match(row.pattern), _SHAPES[1].match(row.pattern)
    if not named and not ranked:
        return (f"key kind {row.kind!r}: pattern {row.pattern!r} is none of gefen/<segment>/{{opt}}, "
                "gefen/<segment>/{fqn}, gefen/<segment>/{opt}/{r}")
    taken = _RANKED if ranked else _NAMED
    if row.segment in taken or row.segment == HEADER.segment:
        return (f"key kind {row.kind!r}: its keys {row.pattern} would be another kind's "
                f"({taken.get(row.segment, HEADER.kind)!r}); name its segment otherwise")
    if row.raw and (row.small is not None or ranked or not row.pattern.endswith("{fqn}")):
        return f"key kind {row.kind!r}: only a parameter's state tensor (gefen/<segment>/{{fqn}}) is stored raw"
    return None


def register_rows(rows: Iterable[KeyRow]) -> None:
    """Register a kind's key rows (``kinds.register`` does, for its description's ``key_rows``): all or none,
    ValueError naming the first that cannot be (a taken key kind, a segment another kind's keys use)."""
    rows = tuple(rows)
    kinds, segments = set(), set()
    for row in rows:
        why = _refusal(row)
        if why is None and row.kind in kinds:
            why = f"key kind {row.kind!r} is given twice"
        if why is None and (row.segment, row.ranked) in segments:
            why = f"key kind {row.kind!r}: segment {row.segment!r} given twice"
        if why:
            raise ValueError(f"cannot register key rows: {why}")
        kinds.add(row.kind)
        segments.add((row.segment, row.ranked))
    for row in rows:
        _ROWS[row.kind] = row
        PATTERNS[row.kind] = row.pattern
        (_RANKED if row.ranked else _NAMED)[row.segment] = row.kind
        if row.small is not None:
            SMALL_KINDS[row.kind] = row.small


def unregister_rows(kinds: Iterable[str]) -> None:
    """Drop registered rows (a test's kind, restored after); the header stays."""
    for kind in kinds:
        row = _ROWS.get(kind)
        if row is None or row is HEADER:
            continue
        del _ROWS[kind], PATTERNS[kind]
        SMALL_KINDS.pop(kind, None)
        (_RANKED if row.ranked else _NAMED).pop(row.segment, None)


def entry_key(kind: str, name: str) -> str:
    """The key of ``name`` (an optimizer id or a parameter's fqn) of a registered kind keyed by one name,
    from its row (Gefen's records: ``entry_key("gefen", opt)`` is ``gefen/optimizer/{opt}``)."""
    r = _ROWS.get(kind)
    if r is None or r is HEADER or r.ranked:
        raise ValueError(f"{kind!r} is no key kind keyed by one name")
    return r.key(name)


def optimizer_id(param_names: list[str] | tuple[str, ...]) -> str:
    """An optimizer's id in the records' keys: its first parameter's name, unique across pipeline
    stages ("" for an optimizer without parameters, which writes no record)."""
    return param_names[0] if param_names else ""


class FormatError(GefenCheckpointError):
    """An entry that does not follow the format: the checkpoint is corrupt, foreign or edited."""


def header_key() -> str:
    return HEADER.pattern


@dataclass(frozen=True)
class Key:
    """A parsed key: what the entry is, and whose.

    ``kind`` is a registered row's key kind (``header``, or one of a kind's rows: Gefen's ``gefen``,
    ``codebook``, ``qcodes``, ...), not the key's segment; ``name`` is the optimizer id or the
    parameter's fqn (empty for the header); ``rank`` the source rank of a v1 entry.
    """

    kind: str
    name: str = ""
    rank: int | None = None


_RANK_KEY = re.compile(r"^([^/]+)/(.+)/(\d+)$")


def parse_key(key: str) -> Key | None:
    """The ``Key`` of an entry name (without the ``optimizer.`` prefix) of a registered row; None otherwise.

    Optimizer ids and fqns are dotted names without ``/``, so a trailing
    ``/{r}`` only ever means a v1 rank entry.
    """
    if not key.startswith(PREFIX):
        return None
    rest = key[len(PREFIX):]
    if rest == HEADER.segment:
        return Key(HEADER.kind)
    m = _RANK_KEY.match(rest)
    if m and m.group(1) in _RANKED:
        return Key(_RANKED[m.group(1)], m.group(2), int(m.group(3)))
    segment, sep, name = rest.partition("/")
    if not sep or not name or "/" in name:
        return None
    kind = _NAMED.get(segment)
    return Key(kind, name) if kind is not None else None


def is_gefen_key(key: str) -> bool:
    return key.startswith(PREFIX)


def is_raw_entry(flat_key: str) -> bool:
    """Whether a save writes this DCP entry (flattened: ``optimizer.gefen/grid/...``) as raw bytes."""
    pk = parse_key(flat_key.partition(".")[2])
    return pk is not None and _ROWS[pk.kind].raw


def is_raw_item(flat_key: str, length: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    """Whether a stored item (its chunk's dtype and sizes) is raw: a raw entry's chunk stored in exactly
    its bytes. A framed item is always longer, so one saved again by DCP's own writer reads as DCP's."""
    return is_raw_entry(flat_key) and int(length) == math.prod(sizes) * torch.empty((), dtype=dtype).element_size()


def grid_shape(shape: tuple[int, ...], period: int) -> tuple[int, ...]:
    """Shape of a blocked parameter's per-block tensors (any kind with a period: magnitude, ``vmean``).

    Blocks run along the last dimension, so the block grid is the parameter's
    shape with the last dimension divided by the period; it shards with the
    parameter's own placements.
    """
    if not shape:
        return ()
    if shape[-1] % period:
        raise ValueError(f"period {period} does not divide the last dimension of shape {tuple(shape)}")
    return tuple(shape[:-1]) + (shape[-1] // period,)
