"""The ``.digests`` file: a digest of every stored byte of a checkpoint, written at save.

DCP checks no integrity on load, and torch's zip records carry a CRC32 only
of their members (not of the zip headers, padding and directory around
them) while ``.metadata`` carries none. So every save through
``gefen_titan.checkpoint.io.writing``'s writers records, beside DCP's files:

* the xxh3-64 digest of every stored item (the bytes ``[offset, offset +
  length)`` of its data file that ``.metadata`` points to: every byte of a
  data file lies in exactly one item);
* the digest and size of ``.metadata`` itself;
* and digests of ``.digests``' own parts, so a flipped byte of it is found
  too.

Every byte of a step folder is therefore covered. xxh3-64 (``xxhash``) is
not cryptographic (it finds corruption, not tampering) and runs at memory
speed, so the digest costs little next to the write or read it rides on.

**With a key** (``checkpoint.digest_key_env`` names an environment variable
holding it; ``key_from_env``; the hashers and the key's scope are
``digest_keys``', re-exported here) every digest of the file, the index line's on
the header included, is keyed BLAKE2b-64 (``hashlib``; ``KEYED_ALGORITHM``)
instead: a MAC, which only a holder of the key can make. The key is never
written or logged. A load with the key refuses a file that is not keyed or
whose index does not match its MAC before ``.metadata`` is unpickled (the
index holds ``.metadata``'s digest); a load without the key refuses a keyed
file (it cannot check it). Keyed hashing runs at ~1 GB/s per core, not at
memory speed: the cost of authenticity (``docs/checkpoints.md``).

The file's bytes (its header, index and sections; version 1 still read)
and the marker ``.metadata`` carries of it are ``digest_format``'s; here it
is read back and checked, its exact size too (bytes appended to it, or cut
from it, are refused), and what does not check out is refused. Whether a
checkpoint without ``.digests`` loads is the checkpoint manager's rule
(``digest_format.expects_digests``, ``docs/checkpoints.md``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from gefen_titan.checkpoint.errors import GefenCheckpointError, fall_back
from gefen_titan.checkpoint.format import digest_format, files
from gefen_titan.checkpoint.format.digest_format import MAGIC, MAX_ROW_BYTES, READ_VERSIONS
from gefen_titan.checkpoint.format.digest_keys import (
    ALGORITHM,
    KEYED_ALGORITHM,
    algorithm,
    current_key,
    hexdigest,
    key_from_env,
    keyed,
    new_hasher,
)

__all__ = ["FILE", "METADATA_FILE", "ALGORITHM", "KEYED_ALGORITHM", "PIECE", "key_from_env", "keyed",
           "current_key", "CorruptCheckpointError", "Digests", "new_hasher",
           "hexdigest", "read", "parsed_once", "corrupt_message", "MAX_INDEX_BYTES",
           "MAX_V1_BYTES", "step_problem"]

FILE = ".digests"
METADATA_FILE = ".metadata"  # DCP's name for it
PIECE = 1 << 20  # bytes the writer and the readers hash at a time: each piece right after its I/O, still in cache
_FIRST_READ = 1 << 16  # bytes read first: the header and the index of a thousand files, or a whole small file
# Bounds a reader holds before it trusts the index (docs/checkpoints.md, threat model): the header and index
# (one ~100-byte line per data file: 64 MiB is ~600,000 data files), a version 1 file (read whole; written
# 2026-12-01/02 by saves of at most thousands of items); a row's is ``digest_format.MAX_ROW_BYTES``.
MAX_INDEX_BYTES = 64 << 20
MAX_V1_BYTES = 256 << 20
_MAX_HEADER = 256  # the header line is ~50 bytes


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


def _bad(checkpoint_id: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(corrupt_message(checkpoint_id, FILE, None, what), FILE, what=what)


def _unsigned(checkpoint_id: str, what: str) -> CorruptCheckpointError:
    """A key mismatch: not damage, so no advice to restore a file."""
    return CorruptCheckpointError(f"checkpoint {checkpoint_id} cannot be authenticated: {FILE}: {what}. Nothing was "
                                  "loaded.", FILE, what=what)


class Digests:
    """What ``.digests`` holds: ``.metadata``'s size and digest, and each item's.

    An item is named by its data file and offset, as DCP's ``.metadata`` names it. Built by the
    writer from ``items[file][offset] = (length, digest)``; read from a file (``read``), each file's
    section is read and checked when one of its items is first asked for. Shared within
    ``parsed_once``: read-only, apart from the sections it caches.
    """

    def __init__(self, metadata_size: int, metadata_digest: str,
                 items: dict[str, dict[int, tuple[int, str]]] | None = None, *,
                 sections: dict[str, tuple[int, int, int, str]] | None = None,
                 read_rows: Callable[[int, int], bytes] | None = None, source: str = "",
                 key: bytes | None = None) -> None:
        self.key = key  # every digest is keyed BLAKE2b-64 with it (None: xxh3-64); never written
        self.algorithm = algorithm(key)
        self.metadata_size = int(metadata_size)
        self.metadata_digest = str(metadata_digest)
        self._items = {str(f): dict(rows) for f, rows in (items or {}).items()}  # decoded sections
        # Read from a file: each section's start, length, rows and digest until it is decoded, read
        # through read_rows (bytes [start, start + length) of the sections), source naming the checkpoint.
        self._sections = dict(sections or {})
        self._read_rows = read_rows
        self._source = source

    def new_hasher(self) -> Any:
        """A hasher of this file's algorithm (and key) for an item's bytes."""
        return new_hasher(self.key)

    def hexdigest(self, data: Any) -> str:
        return hexdigest(data, self.key)

    def item(self, file: str, offset: int, length: int) -> str | None:
        """The recorded digest of the item ``[offset, offset + length)`` of ``file``; None if none was recorded.

        Raises ``CorruptCheckpointError`` (naming ``.digests``) if ``file``'s section is damaged.
        """
        if int(length) == 0:  # an empty item (an empty shard's raw entry) has no bytes to damage
            return self.hexdigest(b"")
        rec = self._rows(file).get(int(offset))
        return rec[1] if rec is not None and rec[0] == int(length) else None

    def files(self) -> list[str]:
        """The data files it records items of."""
        return sorted({*self._items, *self._sections})

    def count(self) -> int:
        """Items recorded (the index says how many each unread section holds)."""
        return sum(len(v) for v in self._items.values()) + sum(s[2] for s in self._sections.values())

    def limit_rows(self, counts: dict[str, int]) -> None:
        """Bound each unread section by the items ``.metadata`` stores in its file (``counts``): a section
        that claims more rows is refused before it is read (its length is bounded by its rows)."""
        for file, (_, _, rows, _) in self._sections.items():
            if rows > counts.get(file, 0):
                raise _bad(self._source, f"its index gives {file} {rows:,} rows, and .metadata stores "
                                         f"{counts.get(file, 0):,} items in it")

    def file_size(self, file: str) -> int:
        """The bytes ``file`` holds as saved (every byte of a data file lies in one item); reads its section."""
        return max((offset + length for offset, (length, _) in self._rows(file).items()), default=0)

    def check(self, file: str) -> None:
        """Read and check ``file``'s section now (``ckpt verify``; a load reads those it needs when it needs them)."""
        self._rows(file)

    def _rows(self, file: str) -> dict[int, tuple[int, str]]:
        rows = self._items.get(file)
        if rows is not None:
            return rows
        section = self._sections.get(file)
        if section is None or self._read_rows is None:
            return {}
        start, length, count, digest = section
        try:
            raw = self._read_rows(start, length)
        except CorruptCheckpointError:
            raise
        except Exception as e:  # OSError: a short or unreadable file
            raise _bad(self._source, f"cannot read the section of {file} ({type(e).__name__}: {e})") from e
        if len(raw) != length or self.hexdigest(raw) != digest:
            raise _bad(self._source, f"the section of {file} does not match its digest in the index")
        rows = digest_format.parse_rows(raw)
        if rows is None or len(rows) != count:  # a digest that matches yet does not parse: a foreign writer
            raise _bad(self._source, f"unreadable rows in the section of {file}")
        self._items[file] = rows
        del self._sections[file]
        return rows

    def to_bytes(self) -> bytes:
        """The file's bytes (``digest_format.encode``: version ``digest_format.FILE_VERSION``)."""
        return digest_format.encode(self.metadata_size, self.metadata_digest,
                                    {file: self._rows(file) for file in self.files()}, self.algorithm, self.hexdigest)

    def check_metadata(self, raw: bytes, checkpoint_id: str, size: int | None = None) -> None:
        """Raise ``CorruptCheckpointError`` unless ``raw`` is the ``.metadata`` this save wrote (``size``:
        its file's size, checked before it is read: ``raw`` is then not looked at)."""
        size = len(raw) if size is None else size
        if size != self.metadata_size or self.hexdigest(raw) != self.metadata_digest:
            what = (f"{size:,} bytes, the save wrote {self.metadata_size:,}" if size != self.metadata_size
                    else f"its {self.algorithm} digest is not the one recorded at save")
            raise CorruptCheckpointError(corrupt_message(checkpoint_id, METADATA_FILE, None, what), METADATA_FILE,
                                         what=what)


_scope = threading.local()  # parsed_once's: .memo, header line -> Digests, while a load runs


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within it, each ``.digests`` is decoded once.

    One load makes several DCP reads (the optimizer's small record reads,
    then the main one), and each reader reads ``.digests`` itself, so that
    no reader trusts bytes another read. Each still reads its header and
    index and checks them (microseconds); an index whose digest matches a
    header already decoded in this scope is that record (the header holds
    the index's digest, the index each section's), so its decoding and its
    sections (checked once, when first needed) are shared. Scoped to a load:
    nothing read outlives it.
    """
    outer = getattr(_scope, "memo", None)
    if outer is None:
        _scope.memo = {}
    try:
        yield
    finally:
        if outer is None:
            _scope.memo = None


def read(open_stream: Callable[[], BinaryIO], checkpoint_id: str, key: Any = None) -> Digests:
    """``.digests`` from a stream opener: its header and index now, each section when first needed
    (a fresh stream each, seeked there). A small file is read whole at once.

    ``CorruptCheckpointError`` (naming ``.digests``) if the header or the
    index is damaged; a section's damage when the section is first needed
    (``Digests.item``, ``Digests.check``). ``key``: check it as a keyed
    file with that key (default: ``current_key()``); a keyed file without
    a key, or an unkeyed one with a key, is refused. The stream must be a
    regular file's (``checkpoint.format.files``): its size is taken first, and no
    read goes past ``MAX_INDEX_BYTES`` before the index is found
    (``MAX_V1_BYTES`` for a version 1 file, read whole).
    """
    key = current_key() if key is None else key
    with open_stream() as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        parts = [f.read(_FIRST_READ)]
        whole = len(parts[0]) >= size
        if not whole and parts[0].startswith(f"{MAGIC} 1 ".encode()):  # version 1: one JSON object, read whole
            if size > MAX_V1_BYTES:
                raise _bad(checkpoint_id, f"{size:,} bytes: a version 1 file is at most {MAX_V1_BYTES:,}")
            parts.append(f.read(size - len(parts[0])))
            whole = True
        got, lines = len(parts[0]), parts[0].count(b"\n")
        if b"\n" not in parts[0][:_MAX_HEADER]:  # no header line: _decode refuses without reading on
            whole = True
        while not whole and lines < 2:  # an index of many files: read on to its end
            if got >= MAX_INDEX_BYTES:
                raise _bad(checkpoint_id, f"no digest header and index within its first {MAX_INDEX_BYTES:,} bytes "
                                          "(the index holds one line per data file)")
            parts.append(f.read(_FIRST_READ))
            got += len(parts[-1])
            lines += parts[-1].count(b"\n")
            whole = got >= size or not parts[-1]
        raw = b"".join(parts)

    def read_range(start: int, length: int) -> bytes:
        with open_stream() as f:
            f.seek(start)
            return f.read(length)

    return _decode(raw, whole, read_range, checkpoint_id, key, size)


def _decode(raw: bytes, whole: bool, read_range: Callable[[int, int], bytes], checkpoint_id: str,
            key: bytes | None = None, size: int | None = None) -> Digests:
    """Every byte counts: the header must be exactly as written (magic,
    version, algorithm, digest in lower-case hex) and the digest must be
    that of what it covers (v2: the index line; v1: the rest of the file),
    so a flipped byte anywhere is refused."""
    head, sep, rest = raw.partition(b"\n")
    header = digest_format.parse_header(head) if sep else None
    if header is None:
        raise _bad(checkpoint_id, "its first line is not a digest header")
    number, algo, digest = header
    version = int(number)
    if version not in READ_VERSIONS or algo not in (ALGORITHM, KEYED_ALGORITHM):
        raise _bad(checkpoint_id, f"digest file version {number} / {algo}: this gefen-titan reads "
                                  f"{', '.join(map(str, READ_VERSIONS))} / {ALGORITHM} or {KEYED_ALGORITHM}")
    if algo == KEYED_ALGORITHM and key is None:
        raise _unsigned(checkpoint_id, "it is signed with a key (keyed digests), and this process has none to check "
                                  "it with: set checkpoint.digest_key_env (gefen-titan ckpt verify: "
                                  "--digest-key-env) to the variable holding the save's key")
    if algo != KEYED_ALGORITHM and key is not None:
        raise _unsigned(checkpoint_id, "a key is set (checkpoint.digest_key_env) but this checkpoint carries no MAC "
                                  "(its digests are unkeyed): it was not saved with the key, or was rewritten "
                                  "by someone without it")
    if version == 1:
        if not whole:
            raise _bad(checkpoint_id, "a version 1 file is read whole")  # read() reads it to its end
        if key is not None:
            raise _unsigned(checkpoint_id, "a version 1 file carries no MAC")
        return _decode_v1(rest, digest, checkpoint_id)
    line, sep, rows = rest.partition(b"\n")
    if not sep or hexdigest(line, key) != digest:
        if key is not None:
            raise _unsigned(checkpoint_id, "its index does not match the MAC on its first line under this key "
                                           "(written without the key, with another one, or damaged)")
        raise _bad(checkpoint_id, "its index does not match the digest on its first line")
    memo = getattr(_scope, "memo", None)
    if memo is not None and head in memo:
        return memo[head]
    try:
        md_size, md_digest, sections = digest_format.parse_index(line)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # a digest that matches, yet no index
        raise _bad(checkpoint_id, f"unreadable index ({type(e).__name__}: {e})") from e
    base = len(head) + 1 + len(line) + 1  # the sections' first byte in the file
    for file, (start, length, count, _) in sections.items():
        if start < 0 or count < 0 or not 0 <= length <= count * MAX_ROW_BYTES:
            raise _bad(checkpoint_id, f"its index gives the section of {file} {length:,} bytes for {count:,} rows "
                                      f"(at most {MAX_ROW_BYTES} bytes a row)")
    expected = base + sum(n for _, n, _, _ in sections.values())
    if size is not None and size != expected:  # every byte lies in the header, the index or one section
        raise _bad(checkpoint_id, f"{size:,} bytes, its index accounts for {expected:,} (cut short, or bytes "
                                  "appended)")
    if whole or all(s + n <= len(rows) for s, n, _, _ in sections.values()):
        read_rows = lambda start, length: rows[start:start + length]  # noqa: E731  (already read)
    else:
        read_rows = lambda start, length: read_range(base + start, length)  # noqa: E731
    record = Digests(md_size, md_digest, sections=sections, read_rows=read_rows, source=checkpoint_id, key=key)
    if memo is not None:
        memo[head] = record
    return record


def _decode_v1(body: bytes, digest: str, checkpoint_id: str) -> Digests:
    if hexdigest(body) != digest:
        raise _bad(checkpoint_id, "its own digest does not match its contents")
    try:
        return Digests(*digest_format.parse_v1(body))
    except (ValueError, KeyError, TypeError) as e:  # a digest that matches yet does not parse: a foreign writer
        raise _bad(checkpoint_id, f"unreadable contents ({type(e).__name__}: {e})") from e


def step_problem(checkpoint_id: str) -> str | None:
    """Why the local step folder ``checkpoint_id`` would not load, checked without reading its data (None:
    it checks out): ``.digests``' header, index and rows; ``.metadata``'s size and digest; each data file
    a regular file exactly as long as its items. ``errors.fall_back`` offers only steps that pass it. A
    step without ``.digests`` (an older save) has nothing to check against but its ``.metadata``.
    """
    folder = os.fspath(checkpoint_id)
    try:
        if files.regular_size(os.path.join(folder, METADATA_FILE)) is None:
            return f"it has no {METADATA_FILE}"
        if files.regular_size(os.path.join(folder, FILE)) is None:
            return None
        record = read(lambda: files.open_regular(os.path.join(folder, FILE))[0], folder)
        stream, size = files.open_regular(os.path.join(folder, METADATA_FILE))
        with stream:  # refused by its size before it is read, if it is not the size recorded
            raw = files.read_whole(stream, size, record.metadata_size, METADATA_FILE, "the size .digests records")
            record.check_metadata(raw, folder, size)
        for file in record.files():
            expected = record.file_size(file)
            found = files.regular_size(os.path.join(folder, file))
            if found != expected:
                return f"{file} is {'missing' if found is None else f'{found:,} bytes'}, its save wrote {expected:,}"
    except (GefenCheckpointError, OSError) as e:
        return getattr(e, "what", None) or str(e)
    return None


def corrupt_message(checkpoint_id: str, file: str, entry: str | None, what: str) -> str:
    """The refusal every rank raises: the file, the entry, and what to do."""
    return (f"checkpoint {checkpoint_id} is corrupt: {file}" + (f", entry {entry}" if entry else "")
            + f": {what}. Restore the file from a copy, or {fall_back(checkpoint_id, step_problem)}; "
            f"`gefen-titan ckpt verify {checkpoint_id}` lists every damaged file. Nothing was loaded.")
