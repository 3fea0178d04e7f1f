"""The byte entries' values (issue 50, items 1 and 3: ``checkpoint.checks.entry_values``, run by the load's entry
stage ``load_checks.read_byte_entry``): what torchtitan's components save passes, a type or range no save
writes is refused naming the entry and the field, by the resume (before anything reaches the model) and
by ``ckpt verify`` alike. One process."""

from __future__ import annotations

import io
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from gefen_titan.checkpoint.checks import entry_values, load_checks
from gefen_titan.checkpoint.errors import GefenCheckpointError
from gefen_titan.ckpt_tools.verify import verify_checkpoint
from tests.helpers import tiny_checkpoint
from tests.helpers.tiny_checkpoint import STEP, Loader, build, manager, save
from tests.helpers.untrusted import replace_item

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _read(key: str, value, source: str = "ckpt/step-5"):
    return load_checks.read_byte_entry(io.BytesIO(_saved(value)), key, source)


def test_what_torchtitans_components_save_passes():
    """torchtitan 0.3.0's LR schedulers (``last_epoch`` only), its train state, a torchdata loader's state
    (the loader ParallelAwareDataloader pickles per DP rank), read back through the entry stage."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheds = LRSchedulersContainer([opt], lambda step: 1.0)
    for _ in range(5):
        opt.step()
        scheds.step()
    sched_state = scheds.state_dict()
    assert sched_state == {"last_epoch": 5}
    loader = StatefulDataLoader(list(range(10)), batch_size=2)
    it = iter(loader)
    next(it), next(it)
    loader_state = loader.state_dict()
    values = {"lr_scheduler.last_epoch": sched_state["last_epoch"], "train_state.step": 5,
              "train_state.ntokens_seen": 5 * 4096, "dataloader.world_size": 2,
              "dataloader.dp_rank_0": pickle.dumps(loader_state)}
    for key, value in values.items():
        assert _read(key, value) == value
    assert entry_values.check_loader_state(loader_state, "dataloader.dp_rank_0") is None
    seeded = {**loader_state, "_shared_seed": (1 << 64) - 1, "_base_seed": -(1 << 63)}  # int64/uint64 seeds pass
    assert _read("dataloader.dp_rank_0", pickle.dumps(seeded)) == pickle.dumps(seeded)


@pytest.mark.parametrize("key, value, text", [
    ("train_state.step", 1 << 63, "entry train_state.step is 9,223,372,036,854,775,808, outside [0, "
                                  "9,007,199,254,740,992]"),
    ("train_state.step", (1 << 53) + 1, "entry train_state.step is 9,007,199,254,740,993, outside"),
    ("train_state.step", True, "entry train_state.step is bool True, not an int"),
    ("train_state.ntokens_seen", -1, "entry train_state.ntokens_seen is -1, outside [0, "),
    ("train_state.ntokens_seen", "x", "entry train_state.ntokens_seen is str 'x', not an int"),
    ("train_state.ntokens_seen", 1.5, "entry train_state.ntokens_seen is float 1.5, not an int"),
    ("train_state.other_count", 1 << 60, "entry train_state.other_count is 1,152,921,504,606,846,976, outside"),
    ("lr_scheduler.last_epoch", torch.tensor([1, 2]), "entry lr_scheduler.last_epoch is Tensor tensor([1, 2]), "
                                                      "not an int"),
    ("lr_scheduler.last_epoch", {"a": "b"}, "entry lr_scheduler.last_epoch is dict {'a': 'b'}, not an int"),
    ("lr_scheduler.last_epoch", -3, "entry lr_scheduler.last_epoch is -3, outside"),
    ("dataloader.world_size", 0, "entry dataloader.world_size is 0, outside [1, 1,048,576]"),
    ("dataloader.world_size", 1 << 40, "entry dataloader.world_size is 1,099,511,627,776, outside [1, 1,048,576]"),
])
def test_a_byte_entry_of_a_wrong_type_or_range_is_refused(key, value, text):
    with pytest.raises(entry_values.EntryValueError) as refused:
        _read(key, value)
    assert text in str(refused.value) and "Nothing was loaded" in str(refused.value), str(refused.value)
    assert isinstance(refused.value, GefenCheckpointError)


@pytest.mark.parametrize("state, text", [
    ({"dataset_state": {"sample_idx": 1 << 80, "epoch": 0}},
     "field dataset_state.sample_idx, is an int of 81 bits, outside [0, "),
    ({"dataset_state": {"sample_idx": 3, "epoch": -1}}, "field dataset_state.epoch, is -1, outside [0, "),
    ({"_snapshot": {"_worker_snapshots": {"worker_0": {"dataset_state": {"sample_idx": "7"}}}}},
     "field _snapshot._worker_snapshots.worker_0.dataset_state.sample_idx, is str '7', not an int"),
    ({"_steps_since_snapshot": 1 << 60}, "field _steps_since_snapshot, is 1,152,921,504,606,846,976, outside"),
    ({"dataset_state": {"inputs_buffer": [5, 1 << 80, 7]}},
     "field dataset_state.inputs_buffer[1], is an int of 81 bits, which no loader state holds"),
    ({"dataset_state": {"elastic_stream": {"leaves": [{"position": 1 << 80}]}}},
     "field dataset_state.elastic_stream.leaves[0].position, is an int of 81 bits, which no loader state holds"),
])
def test_a_loader_position_out_of_range_is_refused_naming_its_field(state, text):
    with pytest.raises(entry_values.EntryValueError) as refused:
        _read("dataloader.dp_rank_3", pickle.dumps(state))
    assert f"entry dataloader.dp_rank_3, {text}" in str(refused.value), str(refused.value)


# ------------------------------------------------------------------ the resume and verify agree
@pytest.fixture
def int_scheduler(monkeypatch):
    """The tiny checkpoint's LR scheduler saving an int, as torchtitan's does (a byte entry, not a tensor)."""
    monkeypatch.setattr(tiny_checkpoint.Sched, "state_dict", lambda self: {"last_epoch": STEP})


def _refused_alike(root: Path, step: Path, resume_step: int, text: str) -> None:
    report = verify_checkpoint(str(step))
    assert not report["ok"] and any(p["check"] == "entry values" and text in p["what"]
                                    for p in report["problems"]), report["problems"]
    net, opt = build(5)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(GefenCheckpointError, match=re.escape(text)):
        manager(root, net, opt).load(step=resume_step)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # nothing reached the model


def test_the_unedited_checkpoint_with_torchtitans_entries_resumes(tmp_path, int_scheduler):
    save(tmp_path)
    assert verify_checkpoint(str(tmp_path / "ckpt" / f"step-{STEP}"))["ok"]
    net, opt = build(5)
    assert manager(tmp_path, net, opt).load(step=STEP)


@pytest.mark.parametrize("key, value, text", [
    ("lr_scheduler.last_epoch", torch.tensor([1, 2]), "entry lr_scheduler.last_epoch is Tensor tensor([1, 2]), "
                                                      "not an int"),
    ("train_state.ntokens_seen", "x", "entry train_state.ntokens_seen is str 'x', not an int"),
])
def test_a_replaced_byte_entry_is_refused_by_the_resume_and_verify(tmp_path, int_scheduler, key, value, text):
    step = save(tmp_path)
    replace_item(step, key, _saved(value))
    _refused_alike(tmp_path, step, STEP, text)


def test_a_step_of_2_to_the_63_in_its_own_folder_is_refused(tmp_path):
    """The attacker's: step 2^63 with its folder renamed to match (so the step binding holds)."""
    big = 1 << 63
    step = save(tmp_path)
    replace_item(step, "train_state.step", _saved(big))
    moved = step.parent / f"step-{big}"
    shutil.move(step, moved)
    _refused_alike(tmp_path, moved, big, "entry train_state.step is 9,223,372,036,854,775,808, outside")


def test_a_loader_position_of_2_to_the_80_is_refused(tmp_path):
    step = save(tmp_path, loader=Loader({"dataset_state": {"sample_idx": 1 << 80, "epoch": 0}}))
    _refused_alike(tmp_path, step, STEP, "entry dataloader.dp_rank_0, field dataset_state.sample_idx, is an int "
                                         "of 81 bits")


# ------------------------------------------------------------------ against the dataset (the loader's load)
@pytest.fixture(scope="module")
def text_dataset():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from gefen_titan.data import corpus
    from gefen_titan.data.elastic_dataset import ElasticTextDataset

    corpus.register_datasets()
    tok = HuggingFaceTokenizer(tokenizer_path=corpus.DEFAULT_TOKENIZER_PATH)
    return lambda: ElasticTextDataset(dataset_name=corpus.DATASET_NAME, dataset_path=None, tokenizer=tok,
                                      seq_len=64, dp_rank=1, dp_world_size=2, infinite=True)


@pytest.mark.parametrize("workers", [0, 3])
def test_a_position_past_the_documents_a_reader_reads_is_refused(text_dataset, workers):
    """``sample_idx`` within the rank's share (or its worker's part of it): one more is refused, naming the
    field, before the dataset changes; the end of the share itself (an epoch read to its end) loads."""
    from gefen_titan.data.elastic_dataset import DataLoaderPositionError
    from gefen_titan.data.stream_reshard import as_worker

    saving = text_dataset()
    it = iter(saving)
    for _ in range(2):
        next(it)
    state = saving.state_dict()
    share = len(saving._original_data)
    documents = share if workers <= 1 else (share - 1 + workers - 1) // workers  # worker 1's part
    with as_worker(1, workers):
        for ok in (state["sample_idx"], documents):
            loading = text_dataset()
            loading.load_state_dict({**state, "sample_idx": ok})
            assert loading._sample_idx == ok
        loading = text_dataset()
        with pytest.raises(DataLoaderPositionError) as refused:
            loading.load_state_dict({**state, "sample_idx": documents + 1, "inputs_buffer": [7]})
    assert f"read {documents + 1!r} documents this epoch (sample_idx), and it reads {documents:,}" in \
        str(refused.value), str(refused.value)
    assert ("worker 1 of dp rank 1" if workers else "dp rank 1") in str(refused.value)
    assert loading._sample_idx == 0 and loading._inputs_buffer == []  # nothing of the state was taken
