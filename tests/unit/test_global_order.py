"""The DP-invariant global data order (gefen_titan/data/global_order.py,
gefen_titan/data/global_loader.py) in one process: samples are torchtitan's,
every global batch holds the same samples at DP 1, 2, 3 and 4 over several
epochs, the loader state is one position that any DP size reads, and the
recipe key chooses the loader and refuses global batches that do not split.
The multi-rank resume through DCP is tests/integration/test_global_order_resume.py."""

from __future__ import annotations

import collections
import json
import random

import numpy as np
import pytest
import torch

from gefen_titan.data import corpus as data
from gefen_titan.data.global_loader import STATE_KEY, DataOrderError, GlobalOrderDataLoader
from gefen_titan.data.global_order import GlobalSampleOrder, epoch_permutation
from gefen_titan.data.indexed import IndexedDataError, IndexedDataset
from gefen_titan.data.indexed_build import build_indexed_dataset
from gefen_titan.recipe import RecipeError, load_recipe

SEQ = 32
G = 12  # global batch: splits at DP 1, 2, 3, 4
LOCAL = {1: 3, 2: 2, 3: 2, 4: 3}  # local batch per DP size: 4, 3, 2 and 1 microbatches a step
DEBUG = "recipes/llama_gefen.toml"
GLOBAL = "recipes/llama_gefen_global_order.toml"


def corpus_texts(n=80):
    """Unique documents from 3 to ~70 tokens: some span samples, most share them."""
    rng = random.Random(7)
    words = "alpha beta gamma delta epsilon zeta theta lambda sigma omega list dict".split()
    return [f"Doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 40))) for i in range(n)]


@pytest.fixture(scope="module")
def tok():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("global_order")
    path = root / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts()))
    return path


@pytest.fixture(scope="module")
def dataset_dir(corpus, tok):
    out = corpus.parent / "ds"
    build_indexed_dataset([corpus], tok, out, progress=False)
    return out


def loader(dataset_dir, tok, world, rank, *, local=None, **cfg):
    return GlobalOrderDataLoader.Config(dataset_path=str(dataset_dir), **cfg).build(
        dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ,
        local_batch_size=local or LOCAL[world],
    )


def rows(batch):
    x, y = batch
    return [(tuple(x["input"][i].tolist()), tuple(y[i].tolist()), tuple(x["positions"][i].tolist()))
            for i in range(y.shape[0])]


def global_batches(loaders, steps):
    """What the trainer reads: per step, gradient-accumulation microbatches on every rank."""
    world = len(loaders)
    accum = G // (loaders[0].local_batch_size * world)
    its = [iter(dl) for dl in loaders]
    out = []
    for _ in range(steps):
        got = []
        for _ in range(accum):
            for it in its:
                got += rows(next(it))
        out.append(got)
    return out


def test_samples_are_torchtitans_at_one_rank_unshuffled(corpus, dataset_dir, tok):
    """Same packing, labels and positions as HuggingFaceTextDataset, bit for bit."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    ours = loader(dataset_dir, tok, 1, 0, local=2, shuffle=False, infinite=False)
    theirs = HuggingFaceTextDataLoader.Config(dataset="gefen_tiny", dataset_path=str(corpus), infinite=False).build(
        dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=SEQ, local_batch_size=2)
    a, b = list(ours), list(theirs)
    assert len(a) == ours.order.samples_per_epoch // 2 and len(a) >= 30
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(x1["input"], x2["input"]) and torch.equal(y1, y2)
        assert torch.equal(x1["positions"], x2["positions"])
    assert set(a[0][0]) == {"input", "positions"}  # what the model takes, nothing else


def test_documents_keep_their_boundaries(dataset_dir, tok):
    order = GlobalSampleOrder(IndexedDataset.open(dataset_dir), SEQ, shuffle=False)
    inputs, labels, positions = order.read(np.arange(order.samples_per_epoch))
    bos, eos = tok.bos_id, tok.eos_id
    assert (positions[:, 0] == 0).all()
    starts = inputs == bos
    assert (positions[starts] == 0).all()  # a document starts at position 0 ...
    assert not (labels == bos).any()  # ... and no label is the next document's BOS
    # One EOS label per document, except those in the final partial sample (dropped).
    ds = order.dataset
    last_pair = np.asarray(ds.offsets[1:]) - np.arange(1, ds.num_documents + 1) - 1
    assert (labels == eos).sum() == (last_pair < order.samples_per_epoch * SEQ).sum()
    assert ((positions[:, 1:] == positions[:, :-1] + 1) | (positions[:, 1:] == 0)).all()


def test_permutation_is_fixed_and_seeded():
    assert epoch_permutation(10, 42, 0).tolist() == [9, 8, 7, 4, 2, 3, 6, 1, 5, 0]
    assert epoch_permutation(10, 42, 1).tolist() == [3, 2, 6, 7, 4, 9, 5, 0, 8, 1]
    assert epoch_permutation(10, 7, 0).tolist() == [3, 7, 4, 5, 8, 6, 9, 1, 2, 0]
    p = epoch_permutation(100_003, 1, 5)
    assert sorted(p.tolist()) == list(range(100_003))


def test_global_batches_are_the_same_at_dp_1_2_3_4_over_several_epochs(dataset_dir, tok):
    order = loader(dataset_dir, tok, 1, 0).order
    per_epoch = order.samples_per_epoch
    steps = 4 * per_epoch // G + 1  # a bit more than 4 epochs
    assert per_epoch % G  # some global batches straddle two epochs
    runs = {}
    for world in (1, 2, 3, 4):
        runs[world] = global_batches([loader(dataset_dir, tok, world, r) for r in range(world)], steps)
    for b in range(steps):
        x, y, p = order.read(order.sample_ids(b * G, G))
        want = collections.Counter(zip(map(tuple, x.tolist()), map(tuple, y.tolist()), map(tuple, p.tolist())))
        for world in (1, 2, 3, 4):
            assert collections.Counter(runs[world][b]) == want, f"global batch {b} at dp {world}"
    # Each epoch visits every sample once, in an order of its own.
    perms = [order.sample_ids(e * per_epoch, per_epoch) for e in range(4)]
    for perm in perms:
        assert sorted(perm.tolist()) == list(range(per_epoch))
    assert len({tuple(p.tolist()) for p in perms}) == 4


def test_state_is_one_position_that_any_dp_size_reads(dataset_dir, tok):
    src = [loader(dataset_dir, tok, 2, r) for r in range(2)]
    global_batches(src, 7)  # 7 steps: 84 samples
    states = [dl.state_dict() for dl in src]
    assert states[0] == states[1] and list(states[0]) == [STATE_KEY]
    assert states[0][STATE_KEY]["consumed_samples"] == 7 * G
    reference = global_batches(src, 5)
    for world in (1, 3, 4):
        dst = [loader(dataset_dir, tok, world, r) for r in range(world)]
        for dl in dst:
            dl.load_state_dict(states[0])
        got = global_batches(dst, 5)
        for b in range(5):
            assert collections.Counter(got[b]) == collections.Counter(reference[b]), (world, b)


def test_resume_refusals_name_what_to_do(dataset_dir, tok):
    dl = loader(dataset_dir, tok, 2, 0)
    state = dl.state_dict()
    state[STATE_KEY]["consumed_samples"] = 12
    other_seed = loader(dataset_dir, tok, 2, 0, seed=7)
    with pytest.raises(DataOrderError, match=r"seed 42 -> 7.*dataloader\.seed"):
        other_seed.load_state_dict(state)
    odd = json.loads(json.dumps(state))
    odd[STATE_KEY]["consumed_samples"] = 10  # not a multiple of 2 x 2
    with pytest.raises(DataOrderError, match="global_batch_size"):
        dl.load_state_dict(odd)
    assert dl.consumed_samples == 0  # refused before anything changed
    with pytest.raises(DataOrderError, match=r"exclude_from_loading"):
        dl.load_state_dict({"dp_rank_0": b"...", "world_size": 2})
    dl.load_state_dict({})  # empty state: valid, as in torchtitan
    dl.load_state_dict(state)
    assert dl.consumed_samples == 12


def test_checkpoint_without_a_global_position_is_refused_before_loading(dataset_dir, tok, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    per_rank = tmp_path / "per_rank"
    dcp.save({"dataloader": {"dp_rank_0": b"x", "world_size": 1}}, checkpoint_id=str(per_rank))
    ours = tmp_path / "ours"
    dl = loader(dataset_dir, tok, 1, 0)
    dcp.save({"dataloader": dl}, checkpoint_id=str(ours))
    dl.prepare_load(str(ours), FileSystemReader(str(ours)).read_metadata())
    with pytest.raises(DataOrderError, match=r"per-rank .*exclude_from_loading"):
        dl.prepare_load(str(per_rank), FileSystemReader(str(per_rank)).read_metadata())


def test_finite_order_stops_after_one_epoch(dataset_dir, tok):
    dl = loader(dataset_dir, tok, 2, 1, infinite=False)
    n = sum(1 for _ in dl)
    assert n == dl.order.samples_per_epoch // (2 * 2)


def test_dataset_sources(corpus, dataset_dir, tok, tmp_path):
    from_file = GlobalOrderDataLoader.Config(dataset_path=str(corpus), cache_dir=str(tmp_path)).build(
        dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=SEQ, local_batch_size=2)
    assert from_file.dataset.fingerprint == IndexedDataset.open(dataset_dir).fingerprint
    assert str(tmp_path) in from_file.dataset.path
    embedded = GlobalOrderDataLoader.Config(cache_dir=str(tmp_path)).build(
        dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=SEQ, local_batch_size=2)
    assert embedded.dataset.num_documents == 2977
    with pytest.raises(DataOrderError, match="build_indexed_dataset.py"):
        GlobalOrderDataLoader.Config(dataset="c4").build(
            dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=SEQ, local_batch_size=2)
    with pytest.raises(IndexedDataError, match="fewer than one sample"):
        GlobalOrderDataLoader.Config(dataset_path=str(dataset_dir)).build(
            dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=10**7, local_batch_size=2)


# ----------------------------------------------------------------- recipes ---


def test_recipe_key_chooses_the_loader():
    cfg = load_recipe(GLOBAL, world_size=2).config
    assert type(cfg.dataloader) is GlobalOrderDataLoader.Config
    assert (cfg.training.global_batch_size, cfg.training.local_batch_size) == (8, 2)
    for world in (1, 4):
        load_recipe(GLOBAL, world_size=world)
    # Any llama_gefen* recipe, from the command line; the default stays elastic.
    cfg = load_recipe(DEBUG, {"dataloader": {"loader": "global_order", "seed": 3},
                              "training": {"global_batch_size": 16}}, world_size=2).config
    assert type(cfg.dataloader) is GlobalOrderDataLoader.Config and cfg.dataloader.seed == 3
    from gefen_titan.data.elastic import ElasticTextDataLoader

    assert type(load_recipe(DEBUG, world_size=2).config.dataloader) is ElasticTextDataLoader.Config
    with pytest.raises(RecipeError, match=r"\[dataloader\] loader: must be one of \['elastic', 'global_order'\]"):
        load_recipe(DEBUG, {"dataloader": {"loader": "megatron"}}, world_size=2)
    with pytest.raises(RecipeError, match=r"on_dp_change: unknown key for GlobalOrderDataLoader"):
        load_recipe(GLOBAL, {"dataloader": {"on_dp_change": "continue"}}, world_size=2)


def test_recipe_refuses_a_global_batch_that_does_not_split():
    with pytest.raises(RecipeError, match=r"\[training\] global_batch_size: .*global_order.* needs a fixed"):
        load_recipe(DEBUG, {"dataloader": {"loader": "global_order"}}, world_size=2)
    with pytest.raises(RecipeError, match=r"global_batch_size 8 is not a multiple of local_batch_size 2 x "
                                          r"data-parallel degree 3 .*make global_batch_size a multiple of 3"):
        load_recipe(GLOBAL, world_size=3)
    with pytest.raises(RecipeError, match=r"local_batch_size values that fit: 1, 2, 3, 6"):
        load_recipe(GLOBAL, {"training": {"global_batch_size": 12, "local_batch_size": 4}}, world_size=2)
