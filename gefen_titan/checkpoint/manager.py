"""torchtitan's CheckpointManager, told the checkpoint's layout before a load.

Components whose state depends on how the checkpoint was written (Gefen's
records, the elastic data loader's per-rank entries) must see the checkpoint
metadata before DCP asks them for load destinations. This subclass does one
thing: before torchtitan's ``dcp.load`` it hands the metadata to every
component that is a ``LoadPreparer`` (the optimizer container, the elastic
data loader), and after the load (or its failure) calls their
``abort_load``. It also tells every component that saves views of live
tensors (``SnapshotsOnSave``) whether saves are asynchronous.

``dcp.load`` is called as torchtitan calls it (``state_dict``,
``checkpoint_id=``), plus one checking reader per load
(``storage.load_reader``), so whatever wraps ``dcp.load`` sees torchtitan's
call. That reader reads and checks ``.metadata`` once: for the
``LoadPreparer``s before ``dcp.load`` (their verdict agreed on every rank),
and DCP's own ``read_metadata`` gets the same object; with no
``LoadPreparer`` the first read is DCP's, inside ``dcp.load``.

Integrity: every DCP save (synchronous or async) goes through
``storage.storage_writer``, which also writes ``.digests``; every load's
reader checks ``.metadata`` against it, checks every stored item, on every
rank, before the first byte reaches a live tensor (``checkpoint.io.reading``),
and refuses data files with bytes no item covers or that ``.metadata`` does
not list (``storage.stray_bytes``). A checkpoint whose ``.metadata`` says its
save wrote ``.digests`` (``digest_format.expects_digests``) is refused without
one unless ``checkpoint.load_without_digests``; one from before digests
(formats v1, v2) loads unchecked, with a warning on every rank. With
``checkpoint.digest_key_env`` saves sign ``.digests`` and loads check the
signature before anything is unpickled (``digests``;
``docs/checkpoints.md``, "Threat model"). Nothing read is executed
(``checkpoint.format.unpickling``).
A full disk: a save that fails part-way with ``ENOSPC`` (synchronous, or
an async save's writer, raised when the next save or the close waits for
it) is reported in one message (``GefenCheckpointError``: the folder, what
to do). The folder it leaves has no ``.metadata`` (DCP renames it into
place last), so a resume never takes it as the latest, and the purge of
``keep_latest_k`` never deletes the newest complete checkpoint: torchtitan's
counts every ``step-N`` folder, so failed saves (or an async save in
flight) among the k newest pushed out every checkpoint a resume can load.

Logs: after each synchronous save one line names the step, the folder,
its bytes and the seconds; before each load one names the step, the folder,
the ranks that wrote it and the mesh it loads onto (``log_lines``).

Scheduling saves, async modes, ``load_step``, ``exclude_from_loading``,
``initial_load_path`` and HF checkpoints are torchtitan's own.
"""

from __future__ import annotations

import errno
import re
import time
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from gefen_titan.checkpoint import log_lines
from gefen_titan.checkpoint.checks.entry_values import COUNT_BOUND
from gefen_titan.checkpoint.errors import METADATA_FILE, GefenCheckpointError, refuse_on_any_rank
from gefen_titan.checkpoint.format import digests
from gefen_titan.checkpoint.io.storage import load_reader, refusal, storage_writer

__all__ = ["GefenCheckpointManager", "LoadPreparer", "SnapshotsOnSave", "step_folders"]

_STEP_NAME = re.compile(r"step-(0|[1-9][0-9]*)")  # torchtitan's f"step-{step}"
_STEP_DIGITS = len(str(COUNT_BOUND))  # more digits: beyond the bound (no int() of a million-digit name)
_HF_INDEX = "model.safetensors.index.json"  # torchtitan's test of an HF checkpoint folder


@runtime_checkable
class LoadPreparer(Protocol):
    """A checkpointed component that plans its load from the checkpoint's metadata.

    ``prepare_load`` runs on every rank before ``dcp.load`` (it may run small
    collective reads of its own and must raise the same error on every rank);
    after it, the component's ``state_dict()`` returns the load destinations.
    ``abort_load`` runs after the load, successful or not, and drops the plan.
    """

    def prepare_load(self, checkpoint_id: str, metadata: Any, prefix: str) -> None: ...

    def abort_load(self) -> None: ...


@runtime_checkable
class SnapshotsOnSave(Protocol):
    """A checkpointed component whose ``state_dict()`` hands DCP views of live tensors.

    An async save writes after later steps have changed those tensors in
    place, so under ``checkpoint.async_mode`` other than ``"disabled"`` the
    manager sets ``snapshot_on_save`` and the component hands copies instead.
    """

    snapshot_on_save: bool


class GefenCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        digest_key_env: str = ""
        """Name of an environment variable holding a key: saves sign ``.digests`` with it
        (keyed BLAKE2b) and loads refuse a checkpoint not signed with it. Empty: unsigned."""

        load_without_digests: bool = False
        """Load a checkpoint whose ``.digests`` was deleted (its ``.metadata`` says the save wrote
        one), unchecked. Off: such a checkpoint is refused. Has no effect when a key is set."""

        @classmethod
        def from_torchtitan(cls, stock: Any) -> Any:
            """torchtitan's ``CheckpointManager.Config`` (a base config function's), or one of
            ours of another class (the plain one for the fault-tolerant variant), as this class
            with the same values, so ``checkpoint.enable = true`` loads through this manager.
            Any other class is returned as it is: a component someone chose, not ours to replace."""
            if isinstance(stock, cls) or not (type(stock) is CheckpointManager.Config
                                              or isinstance(stock, GefenCheckpointManager.Config)):
                return stock
            return cls(**{f.name: getattr(stock, f.name) for f in fields(stock) if f.init})

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # Resolved first: a named but unset variable stops the job before anything is built.
        # getattr: torchtitan's own tests (../shared/tools/torchtitan_peer_tests.sh) pass their Config.
        self._digest_key = digests.key_from_env(getattr(config, "digest_key_env", ""))
        self._load_without_digests = bool(getattr(config, "load_without_digests", False))
        super().__init__(config, **kwargs)
        if not self.enable:  # torchtitan keeps no states then
            return
        log_lines.drop_superseded()  # our save and load lines say what torchtitan's bare ones do, and more
        for component in self.states.values():
            if isinstance(component, SnapshotsOnSave):
                component.snapshot_on_save = str(config.async_mode) != "disabled"

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        try:
            return self._dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            full = no_space(checkpoint_id, e)
            if full is None:
                raise
            raise full from e

    def _wait_for_saving(self) -> None:
        # An async save's failure surfaces here (the next save, or the close).
        try:
            super()._wait_for_saving()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            full = no_space(self.folder, e)
            if full is None:
                raise
            self.save_future = None  # that save is over: the close must not wait on it again
            raise full from e

    def _purge_stale_checkpoints(self) -> None:
        """torchtitan's purge (all but the ``keep_latest_k`` newest ``step-N`` folders), except that it
        never deletes the newest *complete* checkpoint (one with ``.metadata``): folders of saves that
        failed part-way, or of an async save still in flight, count among torchtitan's k and would
        otherwise push out every checkpoint a resume can load."""
        if not self._should_purge():
            return
        # Only well-named step folders (step_folders): torchtitan's search would also queue a file named
        # step-7 or a folder step-5.bak for deletion.
        found = sorted((step, filesystem.join(self.folder, name)) for step, name in step_folders(self.folder).items())
        complete = [path for _, path in found if filesystem.isfile(filesystem.join(path, METADATA_FILE))]
        for _, path in found[: -self.keep_latest_k]:
            if not complete or path != complete[-1]:
                self.purge_queue.put(path)

    def _dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                  enable_garbage_collection: bool, to_hf: bool) -> Any:
        """torchtitan's DCP save with a writer that also records ``.digests`` (HF exports are torchtitan's)."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = storage_writer(checkpoint_id, key=self._digest_key)
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            begin = time.monotonic()
            ret = dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
            # torchtitan's own lines name neither the step nor the folder (log_lines).
            logger.info(log_lines.saved(checkpoint_id, time.monotonic() - begin))
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _find_load_step(self, folder: str = "") -> int:
        """torchtitan's choice of the step to resume (the newest ``step-N`` folder holding a ``.metadata`` or
        an HF index), from the well-named step folders only (``step_folders``): torchtitan's
        ``re.search(r"step-(\\d+)")`` took ``step-1e5`` for step 1 and then failed to find ``step-1``, and a
        folder ``step-99999999999999999999999`` became the step every resume tried and refused."""
        folder = folder or self.folder
        if not filesystem.isdir(folder):
            return -1
        valid = [step for step, name in step_folders(folder, warn=True).items()
                 if any(filesystem.isfile(filesystem.join(filesystem.join(folder, name), f))
                        for f in (METADATA_FILE, _HF_INDEX))]
        return max(valid, default=-1)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        # Every read of this load (the metadata's, the components' small
        # ones, the main one) checks .digests itself; decoded once.
        with digests.parsed_once(), digests.keyed(self._digest_key):
            self._checked_load(state_dict, checkpoint_id)

    def _checked_load(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        # One reader for the whole load: it reads and checks .metadata once,
        # for the components that plan from it and for DCP alike.
        reader = load_reader(checkpoint_id, load_without_digests=self._load_without_digests)
        # Every rank holds the same components in the same order, so every
        # rank prepares them in the same order (their reads are collective).
        prepared = [
            (component, key)
            for key, component in self.states.items()
            if key in state_dict and isinstance(component, LoadPreparer)
        ]
        metadata = None
        if prepared:  # they need it before dcp.load; without them DCP's own read_metadata reads it
            error = None
            try:
                metadata = reader.checked_metadata()
            except GefenCheckpointError as e:
                error = str(e)
            # The same file on every rank gives the same verdict (rank 0 alone
            # lists the folder); agreed all the same, so a rank that could not
            # read it does not leave the others waiting.
            refuse_on_any_rank(error, "the checkpoint cannot be loaded")
        # The model's entries (torchtitan flattens them into state_dict) are
        # its live parameters: DCP would read into them in place. They are
        # read into fresh tensors instead and applied only once dcp.load has
        # returned on this rank, i.e. once DCP's gather after the read step
        # found no rank's read refused: a damaged byte on any rank then
        # leaves every rank's live model as it was, at no collective of ours.
        # Cost: a second copy of the rank's model shard, on its device, for
        # the load's duration. (The optimizer hands fresh targets itself.)
        targets = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        logger.info(log_lines.loading(checkpoint_id, metadata, targets, world))
        try:
            for component, key in prepared:
                component.prepare_load(checkpoint_id, metadata, prefix=f"{key}.")
            # Called as torchtitan calls it (checkpoint_id=...), plus the checking
            # reader: without storage_reader= DCP builds a stock FileSystemReader,
            # which cannot read v3's raw entries and unpickles unrestricted.
            dcp.load(targets, checkpoint_id=checkpoint_id, storage_reader=reader)
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(targets)
            # A raw tensor in `states` (torchtitan's own tests pass one) is
            # loaded in place by torchtitan; here it was read into a fresh
            # target like the model's, so it is applied now, as they are.
            for key, component in self.states.items():
                if key != MODEL and isinstance(component, torch.Tensor) and key in targets:
                    state_dict[key].copy_(targets[key])
        except (CheckpointException, OSError) as e:
            # A refusal or a read failure: DCP raises the same CheckpointException on every rank.
            raise refusal(checkpoint_id, e) from e
        finally:
            for component, _ in prepared:
                component.abort_load()


def step_folders(folder: str, warn: bool = False) -> dict[int, str]:
    """The step folders in ``folder`` that a resume and the purge consider: step -> name, for every
    directory named ``step-N`` with N a decimal int as torchtitan writes it (no sign, no leading zero)
    and at most ``entry_values.COUNT_BOUND`` (2^53: no checkpoint holds a larger step). Anything else named
    like one (``step-abc``, ``step-1e5``, ``step-``, ``step-007``, a step beyond 2^53, a file ``step-7``)
    is left alone; with ``warn`` one warning names each, so an odd name costs a line, not the resume."""
    steps: dict[int, str] = {}
    for name in sorted(filesystem.listdir(folder)):
        if "step-" not in name:
            continue
        m = _STEP_NAME.fullmatch(name)
        step = int(m.group(1)) if m and len(m.group(1)) <= _STEP_DIGITS else None
        why = ("its step is no decimal number as torchtitan writes one" if m is None else
               f"its step is beyond {COUNT_BOUND:,} (2^53), the largest a checkpoint may hold"
               if step is None or step > COUNT_BOUND else
               "it is no folder" if not filesystem.isdir(filesystem.join(folder, name)) else None)
        if why is None:
            steps[step] = name
        elif warn:
            logger.warning(f"Checkpoint folder {folder}: ignoring {name!r}: {why}. A resume takes the newest "
                           "well-named step-N folder. Rename or remove it if it is a checkpoint.")
    return steps


def no_space(checkpoint_id: str, error: BaseException) -> GefenCheckpointError | None:
    """One clear message for a save that ran out of disk part-way (``ENOSPC``, however DCP wrapped
    it: a cause, or a rank's failure in a ``CheckpointException``); None for any other error."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            where = e.filename or checkpoint_id
            return GefenCheckpointError(
                f"checkpoint save to {checkpoint_id} failed: no space left on device (writing {where}). That "
                "folder is incomplete (no .metadata): a resume never takes it as the latest, keep_latest_k does not "
                "count it, and the last complete checkpoint still loads. Free space on that file system (or set "
                "checkpoint.folder to another), then resume.")
        if isinstance(e, CheckpointException):  # rank -> (exception, traceback)
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return None
