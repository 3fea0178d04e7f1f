"""The ``.digests`` file: a digest of every stored byte of a checkpoint, written at save.

DCP checks no integrity on load, and torch's zip records carry a CRC32 only
of their members (not of the zip headers, padding and directory around
them) while ``.metadata`` carries none. So every save through
``gefen_titan.checkpoint.writing``'s writers records, beside DCP's files:

* the xxh3-64 digest of every stored item (the bytes ``[offset, offset +
  length)`` of its data file that ``.metadata`` points to: every byte of a
  data file lies in exactly one item);
* the digest and size of ``.metadata`` itself;
* and, on the file's first line, the digest of the rest of the file, so a
  flipped byte of ``.digests`` is found too.

Every byte of a step folder is therefore covered. xxh3-64 (``xxhash``) is
not cryptographic (it finds corruption, not tampering) and runs at memory
speed, so the digest costs little next to the write or read it rides on.

Layout (one ASCII header line, then a JSON object)::

    gefen-digests 1 xxh3_64 <16 hex digits: digest of everything after this line>
    {"metadata": {"size": N, "digest": "<hex>"},
     "items": {"<relative data file>": [[offset, length, "<hex>"], ...], ...}}

A checkpoint without ``.digests`` (written before it existed, by
torchtitan's own writer, or by a tool) still loads, unchecked.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

from gefen_titan.checkpoint.errors import GefenCheckpointError

__all__ = ["FILE", "METADATA_FILE", "ALGORITHM", "PIECE", "CorruptCheckpointError", "Digests", "new_hasher",
           "hexdigest", "parse", "older_steps", "corrupt_message", "file_table"]

FILE = ".digests"
METADATA_FILE = ".metadata"  # DCP's name for it
ALGORITHM = "xxh3_64"
MAGIC = "gefen-digests"
FILE_VERSION = 1
PIECE = 1 << 20  # bytes the writer and the readers hash at a time: each piece right after its I/O, still in cache
_HEADER = re.compile(rf"^{MAGIC} (\d+) ([a-z0-9_]+) ([0-9a-f]{{16}})$")


class CorruptCheckpointError(GefenCheckpointError):
    """A stored byte of a checkpoint differs from what its save wrote.

    ``file`` is the checkpoint file it is in and ``entry`` the DCP entry
    (None for ``.metadata`` and ``.digests`` themselves), so the offline
    tools can name them.
    """

    def __init__(self, message: str, file: str | None = None, entry: str | None = None,
                 what: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.entry = entry
        self.what = what or message


def new_hasher() -> Any:
    """A streaming hasher (``update(bytes-like)``, ``hexdigest()``) of the digests' algorithm."""
    return xxhash.xxh3_64()


def hexdigest(data: Any) -> str:
    """The digest of one bytes-like object, as the file stores it (16 lower-case hex digits)."""
    return xxhash.xxh3_64_hexdigest(data)


_EMPTY = hexdigest(b"")


@dataclass
class Digests:
    """What ``.digests`` holds: ``.metadata``'s size and digest, and each item's.

    ``items[file][offset] = (length, digest)``: an item is named by its data
    file and offset, as DCP's ``.metadata`` names it.
    """

    metadata_size: int
    metadata_digest: str
    items: dict[str, dict[int, tuple[int, str]]] = field(default_factory=dict)

    def item(self, file: str, offset: int, length: int) -> str | None:
        """The recorded digest of the item ``[offset, offset + length)`` of ``file``; None if none was recorded."""
        if int(length) == 0:  # an empty item (an empty shard's raw entry) has no bytes to damage
            return _EMPTY
        rec = self.items.get(file, {}).get(int(offset))
        return rec[1] if rec is not None and rec[0] == int(length) else None

    def count(self) -> int:
        return sum(len(v) for v in self.items.values())

    def to_bytes(self) -> bytes:
        body = json.dumps({
            "metadata": {"size": self.metadata_size, "digest": self.metadata_digest},
            "items": {f: [[o, n, d] for o, (n, d) in sorted(v.items())] for f, v in sorted(self.items.items())},
        }, separators=(",", ":")).encode()
        return f"{MAGIC} {FILE_VERSION} {ALGORITHM} {hexdigest(body)}\n".encode() + body

    def check_metadata(self, raw: bytes, checkpoint_id: str) -> None:
        """Raise ``CorruptCheckpointError`` unless ``raw`` is the ``.metadata`` this save wrote."""
        if len(raw) != self.metadata_size or hexdigest(raw) != self.metadata_digest:
            what = (f"{len(raw):,} bytes, the save wrote {self.metadata_size:,}" if len(raw) != self.metadata_size
                    else f"its {ALGORITHM} digest is not the one recorded at save")
            raise CorruptCheckpointError(corrupt_message(checkpoint_id, METADATA_FILE, None, what), METADATA_FILE,
                                         what=what)


def parse(raw: bytes, checkpoint_id: str) -> Digests:
    """``.digests``'s bytes -> ``Digests``; ``CorruptCheckpointError`` (naming ``.digests``) if they are damaged.

    Every byte counts: the header must be exactly as written (magic,
    version, algorithm, digest in lower-case hex) and the digest must be the
    body's, so a flipped byte anywhere in the file is refused.
    """
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(corrupt_message(checkpoint_id, FILE, None, what), FILE, what=what)

    head, sep, body = raw.partition(b"\n")
    m = _HEADER.match(head.decode("ascii", errors="replace")) if sep else None
    if m is None:
        raise bad("its first line is not a digest header")
    if int(m.group(1)) != FILE_VERSION or m.group(2) != ALGORITHM:
        raise bad(f"digest file version {m.group(1)} / {m.group(2)}: this gefen-titan reads "
                  f"{FILE_VERSION} / {ALGORITHM}")
    if hexdigest(body) != m.group(3):
        raise bad("its own digest does not match its contents")
    try:
        doc = json.loads(body)
        md = doc["metadata"]
        items = {str(f): {int(o): (int(n), str(d)) for o, n, d in rows} for f, rows in doc["items"].items()}
        return Digests(int(md["size"]), str(md["digest"]), items)
    except (ValueError, KeyError, TypeError) as e:  # a digest that matches yet does not parse: a foreign writer
        raise bad(f"unreadable contents ({type(e).__name__}: {e})") from e


def older_steps(checkpoint_id: str) -> list[int]:
    """Steps of the sibling ``step-N`` folders older than this one, newest first (local folders only).

    An error message names the step to resume from; listing a remote
    folder is not worth a round trip there, so URLs get none.
    """
    path = str(checkpoint_id).rstrip("/")
    parent, here = os.path.split(path)
    m = re.fullmatch(r"step-(\d+)", here)
    if "://" in path or not m or not os.path.isdir(parent):
        return []
    steps = [int(n[5:]) for n in os.listdir(parent) if re.fullmatch(r"step-\d+", n)
             and os.path.isfile(os.path.join(parent, n, METADATA_FILE))]
    return sorted((s for s in steps if s < int(m.group(1))), reverse=True)


def corrupt_message(checkpoint_id: str, file: str, entry: str | None, what: str) -> str:
    """The refusal every rank raises: the file, the entry, and what to do."""
    older = older_steps(checkpoint_id)
    advice = (f"resume from an older step with --checkpoint.load_step {older[0]}" if older
              else "resume from an older checkpoint (--checkpoint.load_step N)")
    return (f"checkpoint {checkpoint_id} is corrupt: {file}" + (f", entry {entry}" if entry else "")
            + f": {what}. Restore the file from a copy, or {advice}; `gefen-titan ckpt verify "
            f"{checkpoint_id}` lists every damaged file. Nothing was loaded.")


def file_table() -> str:
    """``docs/checkpoint_format.md``'s table of the ``.digests`` file, generated from this module."""
    rows = [
        ("line 1", f"`{MAGIC} {FILE_VERSION} {ALGORITHM} <hex>`",
         "format name, version, algorithm, and the digest of everything after this line"),
        ("`metadata.size`, `metadata.digest`", "int, hex", f"size and {ALGORITHM} of `{METADATA_FILE}`"),
        ("`items[file]`", "list of `[offset, length, hex]`",
         f"the {ALGORITHM} of each item's stored bytes, named by file and offset as `{METADATA_FILE}` names it"),
    ]
    return "\n".join(["| field | value | what |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)])
