"""The per-worker dataset positions inside a torchdata ``StatefulDataLoader`` state.

torchtitan pickles one ``StatefulDataLoader.state_dict()`` per DP rank. Its
shape depends on ``num_workers``:

* ``0``: the dataset's own state under ``dataset_state``, taken when the
  state is asked for (exact);
* ``W > 0``: a snapshot, ``_snapshot._worker_snapshots.worker_{w}.dataset_state``
  for each worker, taken at ``_snapshot_step``, plus ``_steps_since_snapshot``
  batches yielded since then. torchdata resumes by restoring the snapshot and
  reading those batches again; batches come from the workers in turn,
  starting after ``_last_yielded_worker_id`` and skipping workers whose data
  ran out.

A **unit** is one reading process of a rank: the rank itself with no
workers, else each of its workers. ``read_saved_loader`` returns a rank's
units' dataset states; ``build_loader_state`` writes the state a loader with
``num_workers`` workers resumes from, given one dataset state per unit.
Reaches inside torchdata 0.11's state layout on purpose (it has no public
reader); ``tests/integration/test_stream_resume.py`` checks it against real
worker processes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

__all__ = ["BATCH_SIZE_KEY", "SavedLoader", "build_loader_state", "read_saved_loader", "saved_workers"]

BATCH_SIZE_KEY = "elastic_batch_size"
"""Extra key in the pickled loader state of a loader with workers: its
local batch size, needed to replay the batches read since the last snapshot."""

_SNAPSHOT = "_snapshot"
_WORKER_SNAPSHOTS = "_worker_snapshots"
_LAST_YIELDED = "_last_yielded_worker_id"
_STEPS_SINCE = "_steps_since_snapshot"
_DATASET_STATE = "dataset_state"
_FETCHER_STATE = "fetcher_state"
_FETCHER_ENDED = "fetcher_ended"


@dataclass
class SavedLoader:
    workers: int
    """Worker processes of the saving loader (0: it read in its own process)."""
    dataset_states: list[Any]
    """One dataset state per unit, in worker order (one entry for 0 workers)."""
    steps_since_snapshot: int = 0
    last_yielded_worker: int = -1
    ended: tuple[bool, ...] = ()
    batch_size: int | None = None


def saved_workers(state: dict[str, Any]) -> int:
    """Worker processes of the loader that saved ``state``."""
    if _SNAPSHOT in state:
        return len(state[_SNAPSHOT].get(_WORKER_SNAPSHOTS, {}))
    return 0


def read_saved_loader(state: dict[str, Any]) -> SavedLoader:
    if _SNAPSHOT not in state:
        if _DATASET_STATE not in state:
            raise ValueError("the saved loader state has neither a dataset state nor worker snapshots")
        return SavedLoader(workers=0, dataset_states=[state[_DATASET_STATE]])
    snapshot = state[_SNAPSHOT]
    workers = saved_workers(state)
    if not workers:
        raise ValueError("the saved loader state has a worker snapshot without workers")
    snaps = [snapshot[_WORKER_SNAPSHOTS][f"worker_{w}"] for w in range(workers)]
    return SavedLoader(
        workers=workers,
        dataset_states=[s.get(_DATASET_STATE) for s in snaps],
        steps_since_snapshot=int(state.get(_STEPS_SINCE, 0)),
        last_yielded_worker=int(snapshot.get(_LAST_YIELDED, workers - 1)),
        ended=tuple(bool((s.get(_FETCHER_STATE) or {}).get(_FETCHER_ENDED, False)) for s in snaps),
        batch_size=state.get(BATCH_SIZE_KEY),
    )


def build_loader_state(fresh: dict[str, Any], dataset_states: list[dict[str, Any]]) -> dict[str, Any]:
    """``fresh`` (the state of a loader that has read nothing, as
    ``StatefulDataLoader.state_dict()`` gives it) with its units' dataset
    states replaced: worker w, or the loader itself, starts there."""
    state = copy.deepcopy(fresh)
    if _SNAPSHOT not in state:
        (state[_DATASET_STATE],) = dataset_states
        return state
    snaps = state[_SNAPSHOT][_WORKER_SNAPSHOTS]
    if len(snaps) != len(dataset_states):
        raise ValueError(f"{len(dataset_states)} dataset states for {len(snaps)} workers")
    for w, ds_state in enumerate(dataset_states):
        snaps[f"worker_{w}"][_DATASET_STATE] = ds_state
    return state
