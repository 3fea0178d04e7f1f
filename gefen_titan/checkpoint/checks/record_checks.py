"""The records stage of ``load_checks``: every kind's records parsed and checked without a live model.

The load runs it on its one small read of the records
(``optim.checkpointing.load_context``) and the offline tools on theirs
(``ckpt_tools.saved_records``), so both give the same verdict. The header parses;
each registered kind (``kinds.descriptions()``: Gefen, GefenMuon, ...) reads
and checks its own records, codebooks and the tensors they imply; this
module adds what no one kind can see: a parameter with records of two
kinds, a state tensor no record of a kind that keeps it names, a kind's
state in a format it does not write, and an entry in Gefen's namespace of a
key kind no description claims (state of a later version's kind, or an
edit: loading on without it would drop it without a word). What needs the
live model (the parameters' shapes, the mesh's cuts, ``deterministic``)
stays with the state adapters (``optim.checkpointing``).

Input: the optimizer component's entries (names without ``optimizer.`` ->
DCP metadata) and the values of its small entries (``schema.SMALL_KINDS``).
Each problem is ``(check, entry, what)``: ``check`` one of ``load_checks``'
names, ``entry`` the entry it is about, so ``verify`` can name the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gefen_titan.checkpoint.format import kinds, schema, schema_records
from gefen_titan.checkpoint.format.kinds import CODEBOOKS, RECORD_TENSORS, RECORDS, KindRecords, Problem

__all__ = ["RECORDS", "RECORD_TENSORS", "CODEBOOKS", "SavedRecords", "read_saved", "small_names"]


@dataclass
class SavedRecords:
    header: schema_records.Header
    kinds: dict[str, KindRecords]  # registry name -> its records, for each kind with state in the checkpoint
    checked: list[Problem]  # every problem found, (check, entry name inside "optimizer.", what)
    unknown: list[Problem] = field(default_factory=list)  # of them, the entries of no described key kind

    @property
    def problems(self) -> list[tuple[str, str]]:
        """(entry, what) of every problem."""
        return [(entry, what) for _, entry, what in self.checked]

    @property
    def version(self) -> int:
        return self.header.version


def small_names(entries: dict[str, Any]) -> list[str]:
    """The entries the checks read (``schema.SMALL_KINDS``: header, records, codebooks, v1's rank tables)."""
    return sorted(n for n in entries if (k := schema.parse_key(n)) is not None and k.kind in schema.SMALL_KINDS)


def read_saved(entries: dict[str, Any], values: dict[str, Any]) -> SavedRecords | None:
    """The records, parsed, and every problem found (None: the checkpoint holds no Gefen state).

    Raises ``schema.FormatError`` when the header is unreadable or of an unknown format.
    """
    if schema.header_key() not in values:
        return None
    header = schema_records.Header.from_json(values[schema.header_key()])
    parsed = {name: key for name in entries if (key := schema.parse_key(name)) is not None}
    inp = kinds.RecordsInput(entries, parsed, values, header)
    state = SavedRecords(header, {}, [])
    present = {k.kind for k in parsed.values()}
    for desc in kinds.descriptions():
        if not desc.key_kinds & present:
            continue
        if header.version not in desc.versions:
            state.checked += [(RECORDS, n, f"{n}: {desc.name} state in a format v{header.version} checkpoint "
                                           f"({desc.name} writes v{', v'.join(map(str, sorted(desc.versions)))})")
                              for n, k in sorted(parsed.items()) if k.kind in desc.key_kinds]
            continue
        state.kinds[desc.name] = desc.read(inp, state.checked)
    _across_kinds(parsed, state)
    described = kinds.described_key_kinds() | {"header"}
    for name in sorted(n for n in entries if schema.is_gefen_key(n) and (n not in parsed
                                                                         or parsed[n].kind not in described)):
        kind = name[len(schema.PREFIX):].partition("/")[0]
        state.unknown.append((RECORD_TENSORS, name, (
            f"{name}: an entry of kind {kind!r}, which this gefen-titan does not know (written by a newer one, "
            "or edited): load the checkpoint with the gefen-titan that wrote it")))
    state.checked += state.unknown
    return state


def _across_kinds(parsed: dict[str, schema.Key], state: SavedRecords) -> None:
    """One kind's records per parameter; every state tensor named by a record of a kind that keeps it."""
    owner: dict[str, str] = {}
    for records in state.kinds.values():
        for fqn, rec in records.owner.items():
            if fqn in owner:
                state.checked.append((RECORDS, rec, f"{fqn} has records in {owner[fqn]} and {rec}"))
            owner[fqn] = rec
    for name, key in sorted(parsed.items()):
        keeping = [r for r in state.kinds.values() if key.kind in r.tensor_kinds]
        if keeping and not any(key.name in r.owner for r in keeping):
            state.checked.append((RECORD_TENSORS, name, f"{name} belongs to no optimizer record"))
