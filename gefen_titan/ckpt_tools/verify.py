"""``gefen-titan ckpt verify``: an offline integrity check before an expensive resume.

Verify runs the resume's own checks of what it reads, from the one list
``checkpoint.checks.load_checks`` (not a copy), and a few more; each problem names
the file it is in and the check:

1. **Metadata.** The load's metadata stage: every chunk inside its tensor,
   chunks that tile it, every chunk and byte entry stored and every item an
   entry's, every item inside its file (file-system sizes) and of the length
   its chunk and dtype imply, and the total a full read allocates within the
   files' bytes. Nothing is allocated or read before these pass (an item that
   fails them is not read at all).
2. **Every byte.** Each data file exists; every item is read in full. When
   the checkpoint carries ``.digests`` (``checkpoint.format.digests``: what every
   load checks), each item's digest and ``.metadata``'s are checked, exactly
   as the load checks them, and ``.digests`` itself, its data files' stray
   bytes included. DCP writes each item with ``torch.save``, a zip archive
   holding a CRC32 of every member, so a flipped byte is found without
   ``.digests`` too (``zipfile``'s check; ``torch.load`` itself checks none).
   Then the load's entry stage: byte entries unpickled with the allowlists
   (a data loader's pickled state inside one too), a stored tensor against
   its chunk record, ``train_state.step`` against the folder's step, the
   known byte entries' types and ranges (``checkpoint.checks.entry_values``). The
   tensors each kind's description names ``nonnegative`` finite and >= 0,
   by the load's own function (``kinds.nonnegative_problem``, which its
   adapters run). Beyond the load: every other floating value finite (the
   model's too) and AdamW's ``exp_avg_sq`` >= 0. An item's checks are
   ``ckpt_tools.verify_items``'.
3. **Records.** The load's records stage (``checkpoint.checks.record_checks``):
   every registered kind's records, codebooks and the tensors they imply
   (its ``checkpoint.format.kinds.KindDescription``), an entry of a key kind no
   description claims; and torch optimizers' state (each parameter's
   ``exp_avg``/``exp_avg_sq`` of one shape, with a ``step``). The summary
   has one field per kind with state (its description's ``report_key``).

What it cannot know offline: whether the checkpoint fits the model and
recipe of the run that will resume it (the load checks that, on every rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gefen_titan.checkpoint import progress
from gefen_titan.checkpoint.checks import metadata_fields
from gefen_titan.checkpoint.errors import GefenCheckpointError, restore_advice
from gefen_titan.checkpoint.format import digest_format, digests, kinds, schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools.saved_records import read_records
from gefen_titan.ckpt_tools.verify_items import ItemChecks
from gefen_titan.ckpt_tools.view import Checkpoint, CkptError, Entry, split_state_key
from gefen_titan.optim.kinds import register_builtins

__all__ = ["Problem", "verify_checkpoint", "render"]

_READ = 1 << 24  # bytes per read call (large items are read in pieces)


@dataclass
class Problem:
    file: str | None  # the file it is in (None: not tied to one file)
    entry: str | None  # the DCP entry
    what: str
    check: str | None = None  # its name in load_checks.CHECKS (None: a check of verify's own)


class _Verifier:
    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.problems: list[Problem] = []
        self.warnings: list[str] = []
        self.checked = {"files": 0, "items": 0, "bytes": 0, "entries": 0, "crc_checked": 0, "digests_checked": 0}
        self.digests: digests.Digests | None = None
        self.has_digests = False
        self.bad_sections: set[str] = set()  # data files whose section of .digests is damaged: items unchecked
        self.items = ItemChecks(self.path, self.add, self.checked)  # each item's checks once it is read

    def digest_file(self) -> bool:
        """``.digests`` and ``.metadata`` against it, as the load checks them; False if either is damaged
        or no regular file (its sections: ``digest_sections``, once ``.metadata`` bounds them)."""
        try:
            self.digests = storage.read_digests(self.path)
            self.has_digests = self.digests is not None
            size = storage.file_size(self.path, digests.METADATA_FILE)
            if self.digests is not None and size is not None:
                with storage.open_file(self.path, digests.METADATA_FILE) as f:  # its size before a byte of it
                    self.digests.check_metadata(b"" if size != self.digests.metadata_size else f.read(size),
                                                self.path, size=size)
        except digests.CorruptCheckpointError as err:
            self.has_digests = True
            self.add(err.file, None, err.what, "digests")
            return False
        except GefenCheckpointError as err:  # a FIFO, a device (checkpoint.format.files)
            self.add(None, None, str(err), err.check)
            return False
        except Exception as err:  # a .digests of wrong types the parser has no word for: the resume
            self.has_digests = True  # refuses it (an unreadable file), so verify names it and stops there
            self.add(digests.FILE, None, f"unreadable ({type(err).__name__}: {err}); the resume refuses it", "digests")
            return False
        return True

    def digest_sections(self, ck: Checkpoint) -> None:
        """Each data file's section of ``.digests`` (a load checks it before that file's items), bounded
        first by the items ``.metadata`` stores in the file."""
        if self.digests is None:
            return
        try:
            self.digests.limit_rows(metadata_fields.items_per_file(ck.metadata))
        except digests.CorruptCheckpointError as err:
            self.add(err.file, None, err.what, "digests")
            self.bad_sections.update(self.digests.files())
            return
        for name in self.digests.files():
            try:
                self.digests.check(name)
            except digests.CorruptCheckpointError as err:
                self.add(err.file, None, err.what, "digests")
                self.bad_sections.add(name)

    def add(self, file: str | None, entry: str | None, what: str, check: str | None = None) -> None:
        self.problems.append(Problem(file, entry, what, check))

    # ------------------------------------------------------------ pass 1
    def structure(self, ck: Checkpoint) -> set[tuple[str | None, str | None]]:
        """The load's metadata stage (``ck.problems``: ``metadata_checks.metadata_problems``); the
        (file, entry) pairs whose items must not be read."""
        self.checked["entries"] += len(ck.entries)
        for p in ck.problems:
            self.add(p.file or ".metadata", p.entry, p.what, p.check)
        return {(p.file, p.entry) for p in ck.problems}

    # ------------------------------------------------------------ pass 2
    def every_byte(self, ck: Checkpoint, unsafe: set[tuple[str | None, str | None]]) -> None:
        by_file: dict[str, list] = {}
        for index, info in ck.metadata.storage_data.items():
            if (getattr(info, "relative_path", None), index.fqn) in unsafe or (None, index.fqn) in unsafe:
                continue  # outside its file, or of a length its chunk does not allow: never read
            by_file.setdefault(info.relative_path, []).append((int(info.offset), int(info.length), index, info))
        try:
            present = set(storage.list_files(self.path))
        except OSError:
            present = set(by_file)
        if self.has_digests:  # a save with .digests leaves no byte outside an item: the load's own rule
            try:
                for name, what in storage.stray_bytes(self.path, ck.metadata):
                    self.add(name, None, what, "stray bytes")
            except OSError as err:
                self.add(None, None, f"cannot list the folder ({err})", "stray bytes")
        for extra in sorted(present - set(by_file) - {".metadata"}):
            if extra.endswith(".distcp") and not self.has_digests:
                self.warnings.append(f"{extra} is not referenced by .metadata (left over from another save?)")
        for name in sorted(by_file):
            items = sorted(by_file[name], key=lambda x: x[0])
            size = storage.file_size(self.path, name)
            if size is None:
                continue  # the metadata stage named it
            self.checked["files"] += 1
            end = max(o + n for o, n, _, _ in items)
            if end < size and not self.has_digests:  # with .digests: stray_bytes above
                self.warnings.append(f"{name}: {size - end:,} bytes after its last item")
            with storage.open_file(self.path, name) as stream:
                for offset, length, index, info in items:
                    stream.seek(offset)
                    data = _read_exact(stream, length)
                    self.checked["items"] += 1
                    self.checked["bytes"] += len(data)
                    progress.advance(len(data))  # its own reads, not the checkpoint reader's: the bar counts them
                    if len(data) != length:
                        self.add(name, index.fqn, f"short read: {len(data)} of {length} bytes", "items inside files")
                        continue
                    if self.digests is not None and name not in self.bad_sections:
                        expected = self.digests.item(name, offset, length)
                        self.checked["digests_checked"] += 1
                        # Then the checks below too: they say more about what the damage hit.
                        if expected is None:
                            self.add(name, index.fqn, f"no digest recorded for this item in {digests.FILE}",
                                     "digests")
                        elif self.digests.hexdigest(data) != expected:
                            self.add(name, index.fqn, f"corrupt bytes: {self.digests.algorithm} digest mismatch (the "
                                                      "load refuses it)", "digests")
                    raw = _is_raw(ck, index, length)
                    if info.transform_descriptors:
                        self.warnings.append(f"{name}: {index.fqn} is stored transformed "
                                             f"({', '.join(info.transform_descriptors)}); its bytes were read, "
                                             "not decoded")
                        continue
                    self.items.check(ck, name, index, data, raw)

    # ------------------------------------------------------------ pass 3
    def records(self, ck: Checkpoint) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        opt = ck.optimizer

        def file_of(n: str) -> str | None:
            return opt[n].files[0] if n in opt and opt[n].files else None

        try:
            saved = read_records(ck)
        except CkptError as err:
            self.add(file_of(schema.header_key()), ck.optimizer_key(schema.header_key()), str(err), "records")
            saved = None
        if saved is not None:
            for desc in kinds.descriptions():  # each kind's summary, by its description
                records = saved.kinds.get(desc.name)
                if records is not None and desc.summary is not None and (records.optimizers or records.codebooks):
                    summary[desc.report_key] = desc.summary(records, saved.version)
            for check, n, what in saved.checked:
                self.add(file_of(n), ck.optimizer_key(n), what, check)
        states: dict[str, dict[str, Entry]] = {}
        for n, e in opt.items():
            split = split_state_key(n)
            if split:
                states.setdefault(split[0], {})[split[1]] = e
        for fqn, st in states.items():
            if "exp_avg" in st or "exp_avg_sq" in st:
                missing = [s for s in ("exp_avg", "exp_avg_sq", "step") if s not in st]
                if missing:
                    self.add(None, f"optimizer.state.{fqn}", f"Adam state without {', '.join(missing)}")
                elif st["exp_avg"].shape != st["exp_avg_sq"].shape:
                    self.add(st["exp_avg"].files[0] if st["exp_avg"].files else None, st["exp_avg"].key,
                             f"exp_avg {st['exp_avg'].shape} and exp_avg_sq {st['exp_avg_sq'].shape} differ")
        if states:
            summary["torch_state_params"] = len(states)
        if not opt:
            self.warnings.append("no optimizer state: a model-only checkpoint")
        return summary


def _read_exact(stream, length: int) -> bytes:
    parts, left = [], length
    while left > 0:
        part = stream.read(min(left, _READ))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def verify_checkpoint(path: str, key: bytes | None = None) -> dict[str, Any]:
    """The report ``verify`` prints (``--json`` prints exactly this).

    ``ok``: no problem found; ``verdict``: ``verified`` (no problem, and
    every byte matched ``.digests``), ``unchecked`` (no problem, but the
    checkpoint predates digests: its bytes are not proven) or ``failed``.
    ``key``: check keyed digests (a MAC) with it; a checkpoint not signed
    with it fails.
    """
    register_builtins()  # the built-in kinds' descriptions, which the checks and summaries read
    with digests.keyed(key):
        return _verify(path)


def _verify(path: str) -> dict[str, Any]:
    v = _Verifier(path)
    summary: dict[str, Any] = {}
    intact = v.digest_file()
    try:
        ck = Checkpoint(path) if intact else None  # a damaged .digests: .metadata is not unpickled unchecked
    except CkptError as err:
        v.add(".metadata", None, str(err), err.check)
        ck = None
    if ck is not None:
        v.digest_sections(ck)
        if not v.has_digests and digest_format.expects_digests(ck.metadata):
            v.add(digests.FILE, None, "missing, and .metadata says the save wrote one (deleted or lost since): "
                                      "a load refuses this checkpoint", "digests present")
        unsafe = v.structure(ck)
        v.every_byte(ck, unsafe)
        if not ck.problems:  # reading the records would allocate what .metadata claims
            summary = v.records(ck)
    first = next((p for p in v.problems if p.file), v.problems[0] if v.problems else None)
    report: dict[str, Any] = {
        "path": v.path,
        "ok": not v.problems,
        "verdict": "failed" if v.problems else ("verified" if v.has_digests else "unchecked"),
        "problems": [asdict(p) for p in v.problems],
        "warnings": v.warnings,
        "checked": v.checked,
        "digests": v.has_digests,
        **summary,
    }
    if first is not None:
        report["first_bad_file"] = first.file
        report["advice"] = restore_advice(path, first.file, digests.step_problem)
    return report


def _is_raw(ck: Checkpoint, index: Any, length: int) -> bool:
    """Whether a stored item is a v3 raw one (``schema.is_raw_item``), from its entry's chunk record."""
    e = ck.entries.get(index.fqn)
    if e is None or not e.is_tensor or index.offset is None:
        return False
    sizes = next((s for o, s in e.chunks if o == tuple(index.offset)), None)
    return sizes is not None and schema.is_raw_item(index.fqn, length, e.dtype, tuple(sizes))


def render(report: dict[str, Any]) -> str:
    c = report["checked"]
    read = (f"{c['files']} file(s), {c['items']:,} items, {c['bytes'] / 1e6:.2f} MB read, "
            f"{c['crc_checked']:,} CRC32 checked, "
            + (f"{c['digests_checked']:,} digests checked" if report.get("digests") else
               f"no {digests.FILE} (loads read this checkpoint unchecked)"))
    lines = []
    if report["ok"]:
        word = "OK" if report["verdict"] == "verified" else "UNCHECKED"
        lines.append(f"{word:<8}{report['path']}: {read}")
        if report["verdict"] != "verified":
            lines.append(f"        no {digests.FILE} (a format from before digests): every check passed, but its "
                         "bytes are not proven to be the save's")
        for desc in kinds.descriptions():
            s = report.get(desc.report_key)
            if s is not None and desc.summary_line is not None:
                lines.append(f"        {desc.summary_line(s)}")
        if report.get("torch_state_params"):
            lines.append(f"        torch optimizer state for {report['torch_state_params']} parameters: consistent")
    else:
        n = len(report["problems"])
        lines.append(f"FAILED  {report['path']}: {n} problem(s); first bad file: {report['first_bad_file'] or '-'}")
        for p in report["problems"][:20]:
            lines.append(f"  {p['file'] or '-'}: {p['entry'] or '-'}: {p['what']}")
        if n > 20:
            lines.append(f"  ... {n - 20} more (--json lists all)")
        lines.append(f"what to do: {report['advice']}")
        lines.append(f"checked: {read}")
    for w in report["warnings"][:10]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
