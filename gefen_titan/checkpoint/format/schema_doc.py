"""The format's key tables as ``docs/checkpoint_format.md`` shows them: per version, each key
pattern (``schema.PATTERNS``), its value and who writes it: the header's row from here, each kind's rows
from its description (``KindDescription.key_docs``, written beside its key rows in its folder).

Kept apart from ``schema`` (the keys, records and checks) because only the
doc and its test read it; ``tests/unit/test_checkpoint_format_doc.py``
fails when the doc's tables and these rows differ.
"""

from __future__ import annotations

from gefen_titan.checkpoint.format import digest_format, digests, kinds, schema

__all__ = ["keys", "file_table", "key_table"]

# The header's row per version (the format's own); every other row is a kind's (``KindDescription.key_docs``).
_HEADER = {
    4: ('str (json) {"format": "gefen-titan", "version": 4, "blocking": "agreed"}', "every rank (same)"),
    3: ('str (json) {"format": "gefen-titan", "version": 3, "blocking": "agreed"}', "every rank (same)"),
    2: ('str (json) {"format": "gefen-titan", "version": 2, "blocking": "agreed"}', "every rank (same)"),
    1: ('str (json) {"format": "gefen-titan", "version": 1} (newer writers add "blocking": "per_rank")',
        "every rank (same)"),
}


def keys() -> dict[int, list[tuple[str, str, str]]]:
    """version -> [(key pattern, value, written by)]: the header's row, then each registered kind's rows in
    registration order (Gefen's, then GefenMuon's); the doc's tables are these rows."""
    out = {}
    for version, (value, by) in _HEADER.items():
        rows = [(schema.PATTERNS[schema.HEADER.kind], value, by)]
        for desc in kinds.descriptions():
            rows += [(schema.PATTERNS[kind], v, b) for kind, v, b in desc.key_docs.get(version, ())]
        out[version] = rows
    return out


def key_table(version: int) -> str:
    """The markdown key table of a version, as ``docs/checkpoint_format.md`` shows it."""
    rows = ["| key | value | written by |", "|---|---|---|"]
    rows += [f"| `{key}` | {value} | {by} |" for key, value, by in keys()[version]]
    return "\n".join(rows)


def file_table() -> str:
    """``docs/checkpoint_format.md``'s table of the ``.digests`` file, generated from the constants of
    ``digests`` and ``digest_format``."""
    algo, md = digests.ALGORITHM, digests.METADATA_FILE
    rows = [
        ("line 1", f"`{digest_format.MAGIC} {digest_format.FILE_VERSION} {algo} <hex>`",
         "format name, version, algorithm, and the digest of line 2 (the index); saved with a key "
         f"(`checkpoint.digest_key_env`) the algorithm is `{digests.KEYED_ALGORITHM}` and every digest of the file "
         "is a MAC"),
        ("line 2: `metadata.size`, `metadata.digest`", "int, hex", f"size and {algo} of `{md}`"),
        ("line 2: `files[file]`", "`[start, length, rows, hex]`",
         "where the data file's section lies (counted from the first byte after line 2), its row count and its "
         f"{algo}"),
        ("each section: one line per item", "`<offset> <length> <hex>`",
         f"the {algo} of the item's stored bytes, named by file and offset as `{md}` names it; "
         "sections in the index's order, rows by offset"),
    ]
    return "\n".join(["| field | value | what |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)])
