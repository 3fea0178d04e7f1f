"""How a checked reader (``checkpoint.io.reading``) reads and decodes a rank's items: each piece hashed while
it is still in cache (one pass over memory, not two), raw items into uninitialized buffers (no zero fill)
or straight into their target, torch.saved items as ``bytes`` that ``io.BytesIO`` reads in place;
``ItemReads`` is the reader's half that reads a plan's items, checks each (its file's size, its digest,
the entry stage of ``load_checks``) and decodes them (raw views, ``torch.load``, safe byte entries).

Every function returns fewer bytes than asked at the end of the file; the caller compares. The caller
also bounds ``length`` by the file's size before calling (``metadata_checks``: items inside files), since
each allocates what it is asked for.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from gefen_titan.checkpoint import progress
from gefen_titan.checkpoint.checks import load_checks, metadata_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError, root_cause
from gefen_titan.checkpoint.format import digests as dg
from gefen_titan.checkpoint.format import files, schema, unpickling

__all__ = ["ItemReads", "load_bytes", "read_into", "read_raw", "read_framed"]


def _fill(f: Any, view: memoryview, hasher: Any) -> int:
    """Read into ``view`` piece by piece, each piece hashed while it is still
    in cache (one pass over memory, not two); the bytes read."""
    n = 0
    while n < len(view):
        got = f.readinto(view[n:n + dg.PIECE])
        if not got:
            break
        if hasher is not None:
            hasher.update(view[n:n + got])
        n += got
    return n


def read_into(f: Any, target: torch.Tensor, hasher: Any) -> memoryview:
    """Fill a contiguous CPU tensor's bytes from ``f``; the bytes read (fewer at the end of the file)."""
    if not target.nbytes:
        return memoryview(b"")
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    return view[:_fill(f, view, hasher)]


def read_raw(f: Any, length: int, hasher: Any) -> memoryview:
    """A raw item's bytes (fewer at the end of the file) in an uninitialized
    buffer (no zero fill), which the item is then viewed in without a copy."""
    view = memoryview(torch.empty(length, dtype=torch.uint8).numpy())
    return view[:_fill(f, view, hasher)]


def read_framed(f: Any, length: int, hasher: Any) -> bytes:
    """A torch.saved item's bytes (fewer at the end of the file), as ``bytes``:
    ``io.BytesIO`` then reads them in place, without a copy."""
    parts, n = [], 0
    while n < length:
        part = f.read(length - n)
        if not part:
            break
        if hasher is not None:
            hasher.update(part)
        parts.append(part)
        n += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class ItemReads:
    """The item half of ``reading``'s checked readers (a mixin): reads the items of a rank's plan, checks
    each, decodes them. It uses the reader's ``storage_data``, ``fs``, ``path``, ``transforms``, its
    ``_id()`` and the per-set-up caches ``_set_up``, ``_chunks``, ``_layouts`` (``reading``)."""

    def _is_raw(self, index: Any) -> bool:
        return self._raw_layout(index) is not None

    def _stream(self, req: Any, data: Any) -> Any:
        return self._stream_of(req.storage_index, data, req)

    def _stream_of(self, index: Any, data: Any, req: Any = None) -> Any:
        info = self.storage_data[index]
        return self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(data))

    def _is_byte_entry(self, index: Any) -> bool:
        return isinstance(self._set_up.state_dict_metadata.get(index.fqn), BytesStorageMetadata)

    def _tensor(self, req: Any, data: Any) -> torch.Tensor:
        """The stored chunk: raw bytes viewed in place (no copy), else torch.load."""
        layout = self._raw_layout(req.storage_index)
        if layout is None:
            stream = self._stream(req, data)
            if not stream.seekable():
                stream = io.BytesIO(stream.read(-1))
            unpickling.check_archive(stream, f"entry {req.storage_index.fqn}", self._id())  # no inflating
            t = torch.load(stream, map_location="cpu", weights_only=True)
            chunk = self._chunk(req.storage_index)
            why = load_checks.stored_tensor_problem(req.storage_index.fqn, t, *chunk) if chunk else \
                f"entry {req.storage_index.fqn}: its stored item is no chunk of the entry"
            if why:
                problem = load_checks.Problem("stored tensors", self.storage_data[req.storage_index].relative_path,
                                              req.storage_index.fqn, why)
                raise GefenCheckpointError(load_checks.refusal(self._id(), [problem]))
            return t
        dtype, sizes = layout
        if not len(data):
            return torch.empty(sizes, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).view(sizes)

    def _chunk(self, index: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """(dtype, sizes) of a tensor item's chunk record in ``.metadata``; None if it is no chunk."""
        md = self._set_up.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return None
        chunks = self._chunks.get(index.fqn)
        if chunks is None:
            chunks = self._chunks[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        sizes = chunks.get(tuple(index.offset or ()))
        return None if sizes is None else (md.properties.dtype, sizes)

    def _raw_layout(self, index: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """(dtype, sizes) of a raw item (``schema.is_raw_item``); None for a framed one."""
        if index in self._layouts:
            return self._layouts[index]
        layout = None
        if schema.is_raw_entry(index.fqn) and not (self.storage_data[index].transform_descriptors or ()):
            chunk = self._chunk(index)
            if chunk is not None and schema.is_raw_item(index.fqn, self.storage_data[index].length, *chunk):
                layout = chunk
        self._layouts[index] = layout
        return layout

    def _direct_targets(self, plan: LoadPlan, planner: Any) -> dict[Any, torch.Tensor]:
        """Raw items whose one request takes the whole stored chunk into a
        contiguous CPU target of its dtype: read into the target itself.

        Raw entries are Gefen's state (v3's qcodes and grid), whose load
        destinations are the adapters' staging tensors (``_load_destinations``:
        fresh, installed only after every rank's checks agree), never live
        state; so bytes that fail their check there are discarded with the
        staging, and the copy of held bytes into the target is saved (at N
        -> N, every item).
        """
        count: dict[Any, int] = {}
        for req in plan.items:
            count[req.storage_index] = count.get(req.storage_index, 0) + 1
        out = {}
        for req in plan.items:
            index = req.storage_index
            if count[index] != 1 or req.type == LoadItemType.BYTE_IO or not self._is_raw(index):
                continue
            dtype, sizes = self._raw_layout(index)
            if any(req.storage_offsets) or tuple(req.lengths) != sizes:
                continue
            target = planner.resolve_tensor(req).detach()
            if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
                out[index] = target
        return out

    def _read_and_check(self, plan: LoadPlan, record: dg.Digests | None,
                        direct: dict[Any, torch.Tensor]) -> tuple[dict[Any, Any], str | Exception | None]:
        """This rank's items (those of its plan, and the unread ones it was handed), each checked
        (against ``record``'s digests when there is one); ``direct``'s
        read into their targets (the value staged is then the target).

        Never raises: a failure is the returned message (``read_data``
        raises it, DCP's gather raises it on every rank).
        """
        needed = {req.storage_index for req in plan.items}
        wanted = list(needed) + [i for i in (plan.storage_data or []) if i not in needed]
        per_file: dict[str, list[Any]] = {}
        for index in wanted:
            per_file.setdefault(self.storage_data[index].relative_path, []).append(index)
        staged: dict[Any, Any] = {}
        file, entry = dg.METADATA_FILE, None
        try:
            for file in sorted(per_file):
                with files.open_stream(self.fs, self.fs.concat_path(self.path, file)) as f:  # regular only
                    size = f.seek(0, io.SEEK_END)  # the file system's size bounds every buffer allocated below
                    for index in sorted(per_file[file], key=lambda i: int(self.storage_data[i].offset)):
                        entry = index.fqn
                        info = self.storage_data[index]
                        past = metadata_checks.item_past_end(file, entry, int(info.offset), int(info.length), size)
                        if past:  # before its buffer is allocated
                            return {}, load_checks.refusal(self._id(), [past])
                        f.seek(int(info.offset))
                        target = direct.get(index)
                        hasher = None if record is None else record.new_hasher()
                        if target is not None and target.nbytes == int(info.length):
                            data = read_into(f, target, hasher)
                        else:
                            target = None
                            data = (read_raw(f, int(info.length), hasher) if self._is_raw(index)
                                    else read_framed(f, int(info.length), hasher))
                        expected = None if record is None else record.item(file, info.offset, info.length)
                        if len(data) != int(info.length):
                            what = f"cannot read it: truncated, {len(data):,} of the item's {int(info.length):,} bytes"
                        elif record is not None and expected is None:
                            what = "no digest was recorded for this item (.digests is from another save?)"
                        elif hasher is not None and hasher.hexdigest() != expected:
                            what = f"{record.algorithm} digest mismatch: its bytes differ from what the save wrote"
                        else:
                            progress.advance(int(info.length))
                            if index in needed:
                                staged[index] = data if target is None else target
                            elif self._is_byte_entry(index):  # one no rank reads: the entry stage all the same
                                load_checks.read_byte_entry(io.BytesIO(self._stream_of(index, data).read(-1)),
                                                            entry, self._id())
                            continue
                        return {}, dg.corrupt_message(self._id(), file, entry, what)
        except dg.CorruptCheckpointError as e:  # the section of .digests for this file (Digests.item)
            return {}, str(e)
        except GefenCheckpointError as e:  # an entry-stage refusal (ForbiddenObjectError, StepMismatchError)
            return {}, e
        except Exception as e:  # OSError, a missing file: the same message shape
            return {}, dg.corrupt_message(self._id(), file, entry, f"cannot read it ({root_cause(e)})")
        return staged, None


def load_bytes(planner: Any, req: Any, value: Any) -> None:
    """What ``DefaultLoadPlanner.load_bytes`` does with a byte entry once
    unpickled, given the value read safely (it would ``torch.load`` it with
    ``weights_only=False``); pinned by ``tests/unit/test_contract_dcp.py``.
    Another planner reads bytes its own way, which cannot be made safe here."""
    if not isinstance(planner, DefaultLoadPlanner) or type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
        raise GefenCheckpointError(f"the load planner {type(planner).__name__} reads byte entries itself (it may "
                                   "unpickle them unrestricted): load with DCP's DefaultLoadPlanner")
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[req.dest_index.fqn], value)
    else:
        planner.state_dict[req.dest_index.fqn] = value
