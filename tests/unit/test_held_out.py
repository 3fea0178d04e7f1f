"""The held-out split: training never reads a held-out document, and the
validator reads exactly the held-out documents, once, at any rank count.

Covers gefen_titan/data/held_out.py (the rule), the ``gefen_tiny_train`` /
``gefen_tiny_held_out`` datasets (corpus.py), gefen_titan/data/eval_loader.py
(the validator's loader) and the flags benchmarks/quality_sweep.py trains with.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from datasets.distributed import split_dataset_by_node
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets import text_datasets
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

from benchmarks import quality_sweep
from gefen_titan.data import corpus
from gefen_titan.data.elastic import ElasticTextDataLoader
from gefen_titan.data.eval_loader import EvalTextDataLoader, pack_one_pass
from gefen_titan.data.held_out import (
    HELD_OUT_DATASET_NAME,
    HELD_OUT_EVERY,
    TRAIN_DATASET_NAME,
    is_held_out,
    split_texts,
)

SEQ_LEN = 256


@pytest.fixture(scope="module")
def tokenizer() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(tokenizer_path=corpus.DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus.read_jsonl_texts(corpus.DEFAULT_DATASET_PATH)


@pytest.fixture(scope="module")
def held_out(texts) -> list[str]:
    return [t for t in texts if is_held_out(t)]


def test_split_is_a_fixed_content_rule(texts, held_out):
    train, out = split_texts(texts)
    assert out == held_out and len(train) + len(out) == len(texts)
    assert not set(train) & set(out)
    assert len(out) == 142  # of 2,977: the split is part of every recorded eval number; it must not drift
    assert abs(len(out) / len(texts) - 1 / HELD_OUT_EVERY) < 0.01
    # By content, not position: another order (and a duplicate) puts every document on the same side.
    shuffled = texts[::-1] + texts[:5]
    train2, out2 = split_texts(shuffled)
    assert set(out2) == set(out) and set(train2) == set(train)


def test_the_two_datasets_partition_the_corpus(texts, held_out):
    corpus.register_datasets()
    train = corpus.load_train_dataset(corpus.DEFAULT_DATASET_PATH)["text"]
    out = corpus.load_held_out_dataset(corpus.DEFAULT_DATASET_PATH)["text"]
    assert out == held_out
    assert train == [t for t in texts if not is_held_out(t)]
    assert text_datasets.DATASETS[TRAIN_DATASET_NAME].loader is corpus.load_train_dataset
    assert text_datasets.DATASETS[HELD_OUT_DATASET_NAME].loader is corpus.load_held_out_dataset
    # Opt-in: the default dataset is still the whole corpus.
    assert len(corpus.load_jsonl_dataset(corpus.DEFAULT_DATASET_PATH)) == len(texts)


def test_the_training_loader_never_reads_a_held_out_document(tokenizer, texts, held_out):
    """One whole pass of the training loader (the elastic one) at 2 ranks: each rank's token stream is
    its block of the training documents, token for token, and nothing else."""
    train = corpus.load_train_dataset(corpus.DEFAULT_DATASET_PATH)
    assert not set(train["text"]) & set(held_out) and len(train) == len(texts) - len(held_out)
    for rank in (0, 1):
        loader = ElasticTextDataLoader.Config(dataset=TRAIN_DATASET_NAME, infinite=False).build(
            dp_world_size=2, dp_rank=rank, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=4)
        stream = torch.cat([y.flatten() for _, y in loader]).tolist()
        docs = split_dataset_by_node(train, rank=rank, world_size=2)["text"]  # torchtitan's split of the ranks
        expected = [t for d in docs for t in tokenizer.encode(d, add_bos=True, add_eos=True)[1:]]
        assert len(stream) > 300 * 4 * SEQ_LEN
        assert stream == expected[:len(stream)] and len(expected) - len(stream) < 4 * SEQ_LEN  # the last partial batch


def _eval_rows(tokenizer, world: int, batch: int) -> list[list[tuple[dict, torch.Tensor]]]:
    cfg = EvalTextDataLoader.Config(dataset=HELD_OUT_DATASET_NAME, infinite=False)
    return [list(cfg.build(dp_world_size=world, dp_rank=r, tokenizer=tokenizer, seq_len=SEQ_LEN,
                           local_batch_size=batch)) for r in range(world)]


@pytest.mark.parametrize("world,batch", [(1, 4), (2, 4), (3, 2)])
def test_the_eval_pass_is_exactly_the_held_out_documents(tokenizer, held_out, world, batch):
    docs = [tokenizer.encode(t, add_bos=True, add_eos=True) for t in held_out]
    ranks = _eval_rows(tokenizer, world, batch)
    assert len({len(r) for r in ranks}) == 1  # the same number of batches on every rank: no hang
    labels = torch.cat([y.flatten() for r in ranks for _, y in r])
    inputs = torch.cat([x["input"].flatten() for r in ranks for x, _ in r])
    assert all(y.shape == (batch, SEQ_LEN) for r in ranks for _, y in r)
    scored = labels != IGNORE_INDEX
    assert labels[scored].tolist() == [t for d in docs for t in d[1:]]  # every label of every document, once
    assert inputs[scored].tolist() == [t for d in docs for t in d[:-1]]
    assert not scored[int(scored.sum()):].any()  # the padding is all at the end
    assert (~scored).sum() < world * batch * SEQ_LEN  # less than one global batch of it


def test_the_eval_pass_is_deterministic(tokenizer):
    a, b = _eval_rows(tokenizer, 2, 4), _eval_rows(tokenizer, 2, 4)
    for ra, rb in zip(a, b):
        for (xa, ya), (xb, yb) in zip(ra, rb, strict=True):
            assert torch.equal(ya, yb) and torch.equal(xa["input"], xb["input"])
            assert torch.equal(xa["positions"], xb["positions"])


def test_eval_rows_are_packed_as_torchtitan_packs_training(tokenizer, held_out):
    """Each full row is the sample torchtitan's own dataset yields (inputs, labels, positions)."""
    ours = [row for (x, y) in _eval_rows(tokenizer, 1, 1)[0] for row in [(x["input"][0], x["positions"][0], y[0])]]
    theirs = list(HuggingFaceTextDataset(HELD_OUT_DATASET_NAME, None, tokenizer, seq_len=SEQ_LEN, infinite=False))
    assert len(ours) == len(theirs) + 1  # ours adds the padded tail
    for (x, pos, y), (t_in, t_y) in zip(ours, theirs):
        assert torch.equal(x, t_in["input"]) and torch.equal(pos, t_in["positions"]) and torch.equal(y, t_y)


def test_pack_one_pass_pads_and_restarts_positions():
    x, y, pos = pack_one_pass([[1, 5, 6, 7, 8, 9, 2], [1, 3, 2]], seq_len=4, row_multiple=3)
    assert x.tolist() == [[1, 5, 6, 7], [8, 9, 1, 3], [0, 0, 0, 0]]
    assert y.tolist() == [[5, 6, 7, 8], [9, 2, 3, 2], [IGNORE_INDEX] * 4]
    assert pos.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1], [0, 0, 0, 0]]


def test_the_benchmark_flags_train_on_the_split_and_validate_on_the_rest():
    """What benchmarks/quality_sweep.py passes, through the recipe layer."""
    from gefen_titan.recipe.cli import load_cli

    argv = ["--job.config", "recipes/llama_gefen.toml", *quality_sweep.held_out_flags(steps=40, every=20)]
    config = load_cli(argv, world_size=2).config
    assert config.dataloader.dataset == TRAIN_DATASET_NAME
    v = config.validator
    assert v.enable and v.steps == -1 and v.freq == 20
    assert type(v.dataloader) is EvalTextDataLoader.Config and v.dataloader.dataset == HELD_OUT_DATASET_NAME
    default = load_cli(["--job.config", "recipes/llama_gefen.toml"], world_size=2).config
    assert default.dataloader.dataset == corpus.DATASET_NAME and not default.validator.enable


def test_the_validation_line_the_benchmark_parses():
    """torchtitan 0.3.0 logs each eval as ``validate step: N  loss: X.XXXX``."""
    source = inspect.getsource(MetricsProcessor.log_validation)
    assert 'validate step: {step:2}  "' in source and 'loss: {loss:7.4f}' in source
    line = "[titan] 2026-12-06 16:08:29,825 - root - INFO - \x1b[33mvalidate step: 40  \x1b[32mloss:  6.1234  tps: 9"
    assert quality_sweep.parse_log(line + "\n").eval == {40: 6.1234}
