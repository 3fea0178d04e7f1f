"""Streaming datasets: what a rank had not read yet, and how new ranks share it.

A ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``) has no
document index. torchtitan gives rank r of N the stream
``split_dataset_by_node(ds, r, N)`` (every N-th file, or every N-th example
when the files do not divide), and with DataLoader workers ``datasets`` splits
that rank's files once more among the workers. What a rank (or worker) saved
is that stream's own position: ``datasets``' state dict (which shard of its
own, how far into it) plus the epoch.

That position is not redistributable as it stands, but it is *replayable*:
rebuilding the same stream (same dataset, same split, same epoch, same worker
identity) and loading the saved state makes ``datasets`` itself yield exactly
the examples that stream had not yielded yet. That replay is a **leaf**::

    {"world": N, "rank": r, "workers": W, "worker": w, "epoch": e,
     "state": <datasets state>, "filters": [[stride, lo, hi, count], ...]}

The source's whole remainder is the union of its leaves. Splitting it among
new ranks adds one filter per leaf: of the examples that reach it, a filter
keeps those whose running ``count % stride`` lies in ``[lo, hi)``, so the
new ranks that share a source stream partition it exactly without knowing its
length (``unit_shares``). A leaf's state and counters advance as it is read,
so a resharded pass can be saved, resumed and resharded again like any other.

The cost is reading: a new rank that shares a source stream with k others
reads that stream whole and keeps 1/k of it (the JSON is parsed, only kept
documents are tokenized). This is the same trade ``datasets`` itself makes
when files do not divide the ranks.

``datasets`` does not promise that every stream resumes exactly (shuffle
buffers are refilled, batched maps may skip), and a buffered shuffle leaves
no trace in the state. ``check_resumable`` therefore allows only the
examples iterables whose resume is exact and tested here, and names the
first other one it finds.

Reaches inside ``datasets`` 4.7 (``IterableDataset._ex_iterable`` and its
``ex_iterable(s)`` chain) and torch's worker-info global (``as_worker``) on
purpose: neither has a public way in. ``datasets`` is pinned for that, and
``tests/integration/test_stream_resume.py`` checks both against real
DataLoader workers.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch.utils.data._utils.worker as _torch_worker
from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node
from torch.utils.data import get_worker_info
from torch.utils.data._utils.worker import WorkerInfo

from gefen_titan.errors import UserError

__all__ = [
    "EXACT_EXAMPLES_ITERABLES",
    "StreamNotResumable",
    "advance_filters",
    "as_worker",
    "check_resumable",
    "current_worker",
    "read_leaves",
    "share_leaves",
    "source_leaves",
    "unit_shares",
]

EXACT_EXAMPLES_ITERABLES = frozenset({"ExamplesIterable", "ArrowExamplesIterable"})
"""Base examples iterables (what ``load_dataset(..., streaming=True)`` builds
for json, parquet, text, csv files, and ``Dataset.to_iterable_dataset``) whose
``state_dict`` resumes at exactly the next example. The wrappers ``datasets``
adds when iterating (formatting, rebatching, node split) keep that."""


class StreamNotResumable(UserError, ValueError):
    """A streaming dataset whose saved position does not say where it was."""


def current_worker() -> tuple[int, int]:
    """(worker id, number of workers) of this DataLoader worker; (0, 0) in
    the main process."""
    info = get_worker_info()
    return (0, 0) if info is None else (info.id, info.num_workers)


@contextlib.contextmanager
def as_worker(worker: int, workers: int):
    """Make ``get_worker_info()`` answer as worker ``worker`` of ``workers``
    (None for ``workers == 0``, the main process), as torchdata's worker loop
    sets it. ``datasets`` reads it when an iteration starts to pick the
    worker's files, so a stream read here is the one that worker read."""
    # torch keeps the worker identity in this module global (no setter).
    saved = _torch_worker._worker_info  # noqa: SLF001
    _torch_worker._worker_info = (  # noqa: SLF001
        None if workers == 0 else WorkerInfo(id=worker, num_workers=workers, seed=0, dataset=None)
    )
    try:
        yield
    finally:
        _torch_worker._worker_info = saved  # noqa: SLF001


def _chain(ex_iterable: Any) -> Iterator[Any]:
    stack = [ex_iterable]
    while stack:
        node = stack.pop()
        yield node
        if getattr(node, "ex_iterable", None) is not None:
            stack.append(node.ex_iterable)
        stack.extend(getattr(node, "ex_iterables", None) or [])


def check_resumable(ds: Any, name: str) -> None:
    """Raise ``StreamNotResumable`` unless ``ds`` is a ``datasets.IterableDataset``
    whose every examples iterable resumes exactly from its state."""
    if not isinstance(ds, IterableDataset):
        raise StreamNotResumable(
            f"dataset {name!r} loads as {type(ds).__name__}, which is neither a map-style "
            "datasets.Dataset nor a datasets.IterableDataset; its saved position cannot be read"
        )
    for node in _chain(ds._ex_iterable):  # noqa: SLF001 - the stream's examples-iterable chain
        kind = type(node).__name__
        if kind == "BufferShuffledExamplesIterable":
            raise StreamNotResumable(
                f"dataset {name!r} is shuffled with a buffer (IterableDataset.shuffle): the buffer's "
                "examples are not in its saved state (datasets refills the buffer on resume), so "
                "where each rank was cannot be known"
            )
        if kind not in EXACT_EXAMPLES_ITERABLES:
            raise StreamNotResumable(
                f"dataset {name!r} is built with {kind} (a map, filter, skip, take, interleave or "
                "concatenation of streams), whose saved state is not known to resume exactly; only "
                "plain file streams (load_dataset(..., streaming=True)) can continue"
            )


# --------------------------------------------------------------- leaves ---


def source_leaves(data_state: dict[str, Any], world: int, rank: int, workers: int, worker: int) -> list[dict]:
    """The remainder of the stream that rank ``rank`` of ``world`` (worker
    ``worker`` of ``workers``) read, as one leaf, from its ``datasets`` state."""
    if not isinstance(data_state, dict) or "examples_iterable" not in data_state:
        raise StreamNotResumable(f"source rank {rank}'s stream state has no datasets position")
    return [{
        "world": int(world), "rank": int(rank), "workers": int(workers), "worker": int(worker),
        "epoch": int(data_state.get("epoch", 0)), "state": copy.deepcopy(data_state), "filters": [],
    }]


def unit_shares(src_units: int, dst_units: int, dst: int) -> list[tuple[int, int, int]]:
    """Which part of each source stream destination ``dst`` reads.

    Lay the ``src_units`` source streams and the ``dst_units`` destinations
    side by side on a line of length ``src_units * dst_units`` (each source
    ``dst_units`` long, each destination ``src_units`` long). Destination
    ``dst`` reads, of source u's examples, those whose running count modulo
    ``dst_units`` falls in the part of u it covers: ``(u, lo, hi)``. Every
    example of every source goes to exactly one destination, each
    destination gets ``1/dst_units`` of the whole in expectation, and each
    source is read by as few destinations as the proportions allow.
    """
    out = []
    for u in range(src_units):
        lo = max(dst * src_units - u * dst_units, 0)
        hi = min((dst + 1) * src_units - u * dst_units, dst_units)
        if lo < hi:
            out.append((u, lo, hi))
    return out


def share_leaves(remainders: list[list[dict]], dst_units: int, dst: int) -> list[dict]:
    """Destination ``dst``'s leaves from every source's remaining leaves."""
    leaves = []
    for u, lo, hi in unit_shares(len(remainders), dst_units, dst):
        for leaf in remainders[u]:
            leaf = copy.deepcopy(leaf)
            if (lo, hi) != (0, dst_units):
                leaf["filters"].append([dst_units, lo, hi, 0])
            leaves.append(leaf)
    return leaves


def advance_filters(filters: list[list[int]]) -> bool:
    """Advance the filter counters for one example; whether it is kept."""
    for f in filters:
        stride, lo, hi, count = f
        f[3] = count + 1
        if not lo <= count % stride < hi:
            return False
    return True


def read_leaves(full: IterableDataset, leaves: list[dict]) -> Iterator[dict]:
    """The examples of ``leaves``, in order, each leaf replayed from its state.

    Mutates the leaves as it reads: when an example is yielded, the first
    leaf's state and counters say exactly what comes after it, and finished
    leaves have been removed, so ``leaves`` is always the remainder.
    """
    while leaves:
        leaf = leaves[0]
        ds = split_dataset_by_node(full, leaf["rank"], leaf["world"])
        ds.set_epoch(leaf["epoch"])
        ds.load_state_dict(copy.deepcopy(leaf["state"]))
        it = iter(ds)
        while True:
            with as_worker(leaf["worker"], leaf["workers"]):
                try:
                    example = next(it)
                except StopIteration:
                    break
            if advance_filters(leaf["filters"]):
                leaf["state"] = ds.state_dict()
                yield example
        leaves.pop(0)
