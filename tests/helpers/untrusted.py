"""Checkpoint folders as a writer without the save's key could leave them (the untrusted-checkpoint tests)."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

from gefen_titan.checkpoint.format import digest_format, digests
from gefen_titan.checkpoint.io import storage


class Payload:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (open, (self.sentinel, "w"))


def rewrite_digests(step: Path, md, key: bytes | None = None) -> None:
    """A consistent ``.digests`` for the folder's current bytes (``md``: its metadata, as written), as a
    writer without the save's key makes it."""
    (step / digests.FILE).write_bytes(digests.Digests(*digest_rows(step, md, key), key=key).to_bytes())


def digest_rows(step: Path, md, key: bytes | None = None) -> tuple[int, str, dict[str, dict[int, tuple[int, str]]]]:
    """What ``.digests`` records of the folder's current bytes: ``.metadata``'s size and digest, and
    ``rows[file][offset] = (length, digest)`` of each item of ``md``."""
    items: dict[str, dict[int, tuple[int, str]]] = {}
    stored = md.storage_data.values() if isinstance(md.storage_data, dict) else [v for _, v in md.storage_data]
    for info in stored:
        path = step / str(info.relative_path)
        if (info.relative_path in (".metadata", digests.FILE) or not path.is_file() or path.parent != step
                or type(info.offset) is not int or type(info.length) is not int):
            continue  # no data file of the folder, or no place in it (fuzzed): nothing to sign
        data = path.read_bytes()[max(info.offset, 0):max(info.offset + info.length, 0)]
        if info.length:
            rows = items.setdefault(info.relative_path, {})
            rows[int(info.offset)] = (int(info.length), digests.hexdigest(data, key))
    raw = (step / ".metadata").read_bytes()
    return len(raw), digests.hexdigest(raw, key), items


def as_pre_digest(step: Path) -> None:
    """The folder as a save from before digests left it (formats v1, v2): no ``.digests``, no marker."""
    md = storage.read_metadata(step)
    md.storage_meta.modules.remove(digest_format.MARKER)
    (step / ".metadata").write_bytes(pickle.dumps(md))
    (step / digests.FILE).unlink()


def plant_in_metadata(step: Path, sentinel: Path, key: bytes | None = None):
    """The clean metadata (read before planting: unpickling the planted file here would run it)."""
    with digests.keyed(key):
        md = storage.read_metadata(step)
    clean = copy.deepcopy(md)
    md.planner_data["__payload__"] = Payload(sentinel)  # unrestricted unpickling hands back a real Metadata
    (step / ".metadata").write_bytes(pickle.dumps(md))
    return clean


def replace_item(step: Path, key: str, data: bytes, key_bytes: bytes | None = None) -> None:
    """Entry ``key``'s stored item replaced by ``data`` (of any length), as a writer without the save's
    key can: its data file rewritten with the items after it moved, ``.metadata`` pointing at them, and
    ``.digests`` rewritten to match (no byte left outside an item, so only the item's content tells)."""
    md = storage.read_metadata(step)
    (index,) = [i for i in md.storage_data if i.fqn == key]
    name = md.storage_data[index].relative_path
    old = (step / name).read_bytes()
    items = sorted((i for i, info in md.storage_data.items() if info.relative_path == name),
                   key=lambda i: md.storage_data[i].offset)
    out = bytearray()
    for i in items:
        info = md.storage_data[i]
        piece = data if i == index else old[info.offset:info.offset + info.length]
        info.offset, info.length = len(out), len(piece)
        out += piece
    (step / name).write_bytes(bytes(out))
    (step / ".metadata").write_bytes(pickle.dumps(md))
    rewrite_digests(step, md, key_bytes)
