"""The bytes of the ``.digests`` file, and the mark ``.metadata`` carries of it: no I/O, no refusal.

Part of ``checkpoint.format.digests``, which reads the file, checks it and
words what it refuses. Here is only what the writer (``Digests.to_bytes``)
and the reader (``digests.read``) must agree on, kept in one place so the
two cannot drift: the header, index and row syntax, and the marker a save
that writes ``.digests`` leaves in ``.metadata``. The parsers return None or
raise Python's own errors (``ValueError``, ``KeyError``, ``TypeError``,
``AttributeError``) on bytes they cannot parse; ``digests`` turns those
into ``CorruptCheckpointError``.

Layout (file version 2): an ASCII header line, a JSON index line, then one
section of rows per data file::

    gefen-digests 2 xxh3_64 <16 hex digits: digest of the index line>
    {"metadata": {"size": N, "digest": "<hex>"},
     "files": {"<relative data file>": [start, length, rows, "<hex of the section>"], ...}}
    <offset> <length> <hex>        one row per item of the first file, by offset
    ...

``start`` counts from the first byte after the index line. The layout keeps
what a rank reads flat in the world size: a checkpoint saved by 1,024 ranks
holds millions of items (one per entry per rank), but a rank reads the
header, the index (one row per data file) and the sections of the files it
reads, each checked against the index when it is first needed. File
version 1 (one JSON object with every item, its digest on the header
line; written 2026-12-01/02) is still read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gefen_titan.checkpoint.format import schema

__all__ = ["MAGIC", "FILE_VERSION", "READ_VERSIONS", "MAX_ROW_BYTES", "MARKER", "expects_digests", "encode",
           "parse_header", "parse_index", "parse_rows", "parse_v1"]

MAGIC = "gefen-digests"
FILE_VERSION = 2
READ_VERSIONS = (1, 2)
# The most bytes a row (``<offset> <length> <16 hex>``) takes: a reader bounds a section by its rows with it.
MAX_ROW_BYTES = 20 + 1 + 20 + 1 + 16 + 1
# In .metadata's storage_meta.modules of every save that wrote .digests: such a checkpoint without one is refused.
MARKER = "gefen-titan.digests"
_HEADER = re.compile(rf"^{MAGIC} (\d+) ([a-z0-9_]+) ([0-9a-f]{{16}})$")
_ROW = re.compile(rb"(\d+) (\d+) ([0-9a-f]{16})\n")

Rows = dict[int, tuple[int, str]]  # one data file's items: offset -> (length, hex digest)


def expects_digests(metadata: Any) -> bool:
    """Whether a checkpoint's ``.metadata`` says its save wrote ``.digests``: the
    save's marker in ``storage_meta.modules`` (every save since 2026-12-03), or
    a raw item of format v3 (only the digesting writers store one; v3's keys
    saved again by DCP's own writer are framed, and carry no digests)."""
    meta = metadata.storage_meta
    if meta is not None and MARKER in (meta.modules or []):
        return True
    sizes = {}
    for key, md in metadata.state_dict_metadata.items():
        if schema.is_raw_entry(key) and isinstance(md, TensorStorageMetadata):
            sizes[key] = (md.properties.dtype, {tuple(c.offsets): tuple(c.sizes) for c in md.chunks})
    for index, info in metadata.storage_data.items():
        if index.fqn in sizes and int(info.length):
            dtype, chunks = sizes[index.fqn]
            chunk = chunks.get(tuple(index.offset or ()))
            if chunk is not None and schema.is_raw_item(index.fqn, info.length, dtype, chunk):
                return True
    return False


def encode(metadata_size: int, metadata_digest: str, rows: dict[str, Rows], algorithm: str,
           hexdigest: Callable[[bytes], str]) -> bytes:
    """The file's bytes (version ``FILE_VERSION``): ``rows`` each data file's items, ``hexdigest`` the
    digest (keyed or not) of the index line and of each section, ``algorithm`` its name on the header."""
    index: dict[str, list[Any]] = {}
    parts, start = [], 0
    for file in sorted(rows):
        section = "".join(f"{o} {n} {d}\n" for o, (n, d) in sorted(rows[file].items())).encode()
        index[file] = [start, len(section), len(rows[file]), hexdigest(section)]
        parts.append(section)
        start += len(section)
    line = json.dumps({"metadata": {"size": metadata_size, "digest": metadata_digest},
                       "files": index}, separators=(",", ":")).encode()
    return f"{MAGIC} {FILE_VERSION} {algorithm} {hexdigest(line)}\n".encode() + line + b"\n" + b"".join(parts)


def parse_header(head: bytes) -> tuple[str, str, str] | None:
    """The header line's version, algorithm and digest, as written; None unless the line is exactly a
    header (magic, a version, an algorithm's name, a digest in lower-case hex)."""
    m = _HEADER.match(head.decode("ascii", errors="replace"))
    return None if m is None else (m.group(1), m.group(2), m.group(3))


def parse_index(line: bytes) -> tuple[int, str, dict[str, tuple[int, int, int, str]]]:
    """A version 2 index line: ``.metadata``'s size and digest, and each data file's section (start,
    length, rows, digest). Raises ``ValueError``, ``KeyError``, ``TypeError`` or ``AttributeError``."""
    doc = json.loads(line)
    md_size, md_digest = int(doc["metadata"]["size"]), str(doc["metadata"]["digest"])
    sections = {str(f): (int(s), int(n), int(c), str(d)) for f, (s, n, c, d) in doc["files"].items()}
    return md_size, md_digest, sections


def parse_rows(raw: bytes) -> Rows | None:
    """A section's rows; None unless every byte of ``raw`` lies in a row."""
    rows = {}
    pos = 0
    for m in _ROW.finditer(raw):
        if m.start() != pos:
            break
        rows[int(m.group(1))] = (int(m.group(2)), m.group(3).decode())
        pos = m.end()
    return rows if pos == len(raw) else None


def parse_v1(body: bytes) -> tuple[int, str, dict[str, Rows]]:
    """A version 1 file after its header line: ``.metadata``'s size and digest, and every data file's
    items. Raises ``ValueError``, ``KeyError``, ``TypeError`` (or ``AttributeError``) on what no save wrote."""
    doc = json.loads(body)
    md = doc["metadata"]
    items = {str(f): {int(o): (int(n), str(d)) for o, n, d in rows} for f, rows in doc["items"].items()}
    return int(md["size"]), str(md["digest"]), items
