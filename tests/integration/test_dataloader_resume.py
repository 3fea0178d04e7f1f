"""Elastic data-loader resume (gefen_titan/data/elastic*.py, issue 6).

The main scenario runs real gloo ranks (torch.multiprocessing) and saves and
loads through ``GefenCheckpointManager`` (torchtitan's DCP save/load plus our
``prepare_load`` hook):

  phase A, 2 ranks: read K batches, save at step K, keep reading (reference),
           and resume a fresh loader at the same degree;
  phase B, 4 ranks: load step K and read to the end of the data;
  phase C, 1 rank:  the same.

The checks work on the token streams the ranks actually yielded: cut at BOS
tokens they give back whole documents, which are looked up in the corpus.
Across the source's yield + its saved buffer and the resumed ranks' yield +
final leftover, every document of the corpus must occur exactly once, and the
resumed ranks must read the documents the source had not read, in its order.

Variants: the embedded ``gefen_tiny`` loader on a small corpus of unique
documents (exhaustive), the same file through ``load_dataset("json")`` (an
HF-style local text dataset, exhaustive), the packaged default corpus (2 -> 4,
first batches only), and a streaming HF dataset (continues; one shuffled
through a buffer must refuse, naming the key; tests/integration/test_stream_resume.py
checks streaming resumes exactly).
Everything else (restart, error, re-resharding, epochs) runs in this process
on checkpoints written by the real 2-rank phase.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from gefen_titan.data import corpus as data
from gefen_titan.data.elastic import ON_DP_CHANGE_KEY, ElasticTextDataLoader
from gefen_titan.data.elastic_dataset import PASS_KEY, DataLoaderReshardError
from gefen_titan.data.elastic_passes import block_pass, decode_pass, encode_pass, plan_reshard
from gefen_titan.data.registry import lift_dataloader_config
from tests.helpers import processes
from tests.helpers.loader_checkpoint import manager as _manager

SEQ, BATCH, K, J = 32, 2, 6, 5  # seq_len, local batch, steps before save, steps compared after
N_DOCS = 90
STEP = K

# ---------------------------------------------------------------- fixtures ---


def _corpus_texts() -> list[str]:
    rng = random.Random(1234)
    words = "alpha beta gamma delta epsilon zeta theta lambda sigma omega list dict tuple".split()
    return [
        f"Document {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 60))) + "."
        for i in range(N_DOCS)
    ]


def _write_corpus(root: str) -> str:
    path = os.path.join(root, "corpus.jsonl")
    with open(path, "w") as f:
        for t in _corpus_texts():
            f.write(json.dumps({"text": t}) + "\n")
    return path


def _register_hf_json(cache_dir: str) -> None:
    """HF-style text datasets on a local file: map-style and streaming."""
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def proc(s):
        return s["text"]

    DATASETS["local_json"] = DatasetConfig(
        path="", sample_processor=proc,
        loader=lambda p: load_dataset("json", data_files=p, split="train", cache_dir=cache_dir),
    )
    DATASETS["local_json_stream"] = DatasetConfig(
        path="", sample_processor=proc,
        loader=lambda p: load_dataset("json", data_files=p, split="train", streaming=True),
    )
    DATASETS["local_json_stream_shuffled"] = DatasetConfig(
        path="", sample_processor=proc,
        loader=lambda p: load_dataset("json", data_files=p, split="train", streaming=True).shuffle(
            seed=0, buffer_size=8),
    )


VARIANTS = {  # name -> (dataset, uses the synthetic corpus)
    "tiny": ("gefen_tiny", True),
    "hfjson": ("local_json", True),
    "default": ("gefen_tiny", False),
    "stream": ("local_json_stream", True),
    "stream_shuffled": ("local_json_stream_shuffled", True),  # built in-process only
}


def _tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)


def _build(variant, corpus, rank, world, tok, *, on_dp_change="continue", infinite=False):
    dataset, synthetic = VARIANTS[variant]
    cfg = ElasticTextDataLoader.Config(
        dataset=dataset, dataset_path=corpus if synthetic else None,
        infinite=infinite, on_dp_change=on_dp_change,
    )
    return cfg.build(dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ, local_batch_size=BATCH)




def _flat(batches):
    """[(inputs, labels, positions) per sample] from a list of batches."""
    out = []
    for x, y in batches:
        for i in range(x["input"].shape[0]):
            out.append((x["input"][i].clone(), y[i].clone(), x["positions"][i].clone()))
    return out


def _leftover(dl):
    ds = dl.dataset
    return list(ds._inputs_buffer)


def _init(rank, world, root):
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/store_{world}", rank=rank, world_size=world
    )


def _phase_a(rank, root, corpus):
    """2 ranks: read K batches, save, keep reading; resume at the same degree."""
    _init(rank, 2, root)
    try:
        _register_hf_json(os.path.join(root, f"hf_cache_a{rank}"))
        tok = _tokenizer()
        out = {}
        for variant in ("tiny", "hfjson", "default", "stream"):
            dl = _build(variant, corpus, rank, 2, tok)
            it = iter(dl)
            before = [next(it) for _ in range(K)]
            mgr = _manager(os.path.join(root, "ckpt", variant), dl)
            mgr.save(curr_step=STEP)
            saved = pickle.loads(dl.state_dict()[f"dp_rank_{rank}"])
            res = {"before": _flat(before), "saved_dataset_state": saved["dataset_state"]}
            res["after_ref"] = _flat([next(it) for _ in range(J)])
            if variant in ("tiny", "hfjson"):
                dl2 = _build(variant, corpus, rank, 2, tok)
                assert _manager(os.path.join(root, "ckpt", variant), dl2).load(step=STEP)
                it2 = iter(dl2)
                res["after_resumed"] = _flat([next(it2) for _ in range(J)])
            out[variant] = res
            mgr.close()
            dist.barrier()
        torch.save(out, os.path.join(root, f"A{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _phase_resume(rank, world, root, corpus):
    """``world`` ranks: load step K of the 2-rank checkpoint, read on."""
    _init(rank, world, root)
    try:
        _register_hf_json(os.path.join(root, f"hf_cache_{world}_{rank}"))
        tok = _tokenizer()
        out = {}
        for variant in ("tiny", "hfjson", "default"):
            if variant == "default" and world != 4:
                continue
            dl = _build(variant, corpus, rank, world, tok)
            mgr = _manager(os.path.join(root, "ckpt", variant), dl)
            assert mgr.load(step=STEP)
            if variant == "default":  # the full corpus: first batches only
                it = iter(dl)
                out[variant] = {"after": _flat([next(it) for _ in range(20)])}
            else:
                out[variant] = {"after": _flat(list(dl)), "leftover": _leftover(dl)}
            mgr.close()
            dist.barrier()
        torch.save(out, os.path.join(root, f"R{world}_{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# A launch takes well under a minute here; a hung one fails, its ranks killed.
LAUNCH_TIMEOUT_S = 600


def _start(fn, args, nprocs):
    """Real processes, forked from the session's fork server; killed if the wait ends early."""
    processes.spawn(fn, args, nprocs, timeout=LAUNCH_TIMEOUT_S, fork_server=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dl_resume"))
    corpus = _write_corpus(root)
    _start(_phase_a, (root, corpus), 2)
    for world in (4, 1):
        _start(_phase_resume, (world, root, corpus), world)
    def load(name):
        return torch.load(os.path.join(root, name), weights_only=False)

    return {
        "root": root,
        "corpus": corpus,
        "A": [load(f"A{r}.pt") for r in range(2)],
        4: [load(f"R4_{r}.pt") for r in range(4)],
        1: [load(f"R1_{r}.pt") for r in range(1)],
    }


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture
def hf_json(tmp_path):
    from torchtitan.hf_datasets.text_datasets import DATASETS

    saved = dict(DATASETS)
    _register_hf_json(str(tmp_path / "hf_cache"))
    yield
    DATASETS.clear()
    DATASETS.update(saved)


# ------------------------------------------------------- stream accounting ---


def _doc_tokens(texts, tok):
    """Each document's input tokens (BOS .. last token before EOS)."""
    return [tuple(tok.encode(t, add_bos=True, add_eos=True)[:-1]) for t in texts]


def _tokens(samples):
    return [int(t) for x, _, _ in samples for t in x.tolist()]


def _split_at_bos(tokens, bos):
    """(fragment before the first BOS, [pieces starting at BOS])."""
    starts = [i for i, t in enumerate(tokens) if t == bos]
    if not starts:
        return list(tokens), []
    bounds = starts + [len(tokens)]
    return list(tokens[: starts[0]]), [tuple(tokens[a:b]) for a, b in zip(bounds, bounds[1:])]


def _docs_of(tokens, lookup, bos, *, allow_last_partial=False):
    """Document ids of a stream that must consist of whole documents."""
    lead, pieces = _split_at_bos(tokens, bos)
    assert lead == [], "stream does not start at a document boundary"
    ids = []
    for n, piece in enumerate(pieces):
        if piece not in lookup:
            assert allow_last_partial and n == len(pieces) - 1, f"piece {n} is not a whole document"
            return ids, piece
        ids.append(lookup[piece])
    return ids, None


def _check_positions(samples):
    for x, y, pos in samples:
        assert x.shape == y.shape == pos.shape == (SEQ,)
        assert int(pos.min()) >= 0 and int(pos.max()) < SEQ


def _check_continues(runs, variant, world, tok):
    """No document repeated, none skipped, order kept, across all ranks."""
    texts = _corpus_texts()
    docs = _doc_tokens(texts, tok)
    assert len(set(docs)) == len(docs)
    lookup = {d: i for i, d in enumerate(docs)}
    bos = tok.bos_id
    src_world = 2
    blocks = np.array_split(np.arange(len(docs)), src_world)  # torchtitan's contiguous split

    # Source: what each rank yielded + its saved buffer = whole documents, the
    # first sample_idx of its block.
    seen, remaining, buffers = [], [], []
    for r in range(src_world):
        a = runs["A"][r][variant]
        st = a["saved_dataset_state"]
        assert st["epoch"] == 0
        ids, _ = _docs_of(_tokens(a["before"]) + list(st["inputs_buffer"]), lookup, bos)
        assert ids == list(blocks[r][: st["sample_idx"]])
        seen += ids
        remaining += list(blocks[r][st["sample_idx"]:])
        buffers.append(list(st["inputs_buffer"]))
    assert any(buffers), "the scenario should carry a partially read buffer"

    # Resumed: each rank first yields the buffers of the source ranks given to
    # it (r * M // N), then whole documents, ending in its leftover.
    read = []
    for t in range(world):
        res = runs[world][t][variant]
        _check_positions(res["after"])
        stream = _tokens(res["after"]) + res["leftover"]
        carried = [tok_ for r in range(src_world) if r * world // src_world == t for tok_ in buffers[r]]
        assert stream[: len(carried)] == carried
        ids, _ = _docs_of(stream[len(carried):], lookup, bos)
        read.append(ids)

    # Together: every document once; the resumed ranks read exactly the unread
    # ones, in the source's order, split contiguously.
    everything = seen + [i for ids in read for i in ids]
    assert collections.Counter(everything) == collections.Counter(range(len(docs)))
    assert [i for ids in read for i in ids] == remaining
    sizes = [len(p) for p in np.array_split(np.arange(len(remaining)), world)]
    assert [len(ids) for ids in read] == sizes
    # Token count conservation: source yield + resumed yield + leftovers.
    total = sum(len(d) for d in docs)
    got = sum(len(_tokens(runs["A"][r][variant]["before"])) for r in range(src_world))
    for t in range(world):
        got += len(_tokens(runs[world][t][variant]["after"])) + len(runs[world][t][variant]["leftover"])
    assert got == total


# ----------------------------------------------------------------- tests ---


@pytest.mark.parametrize("variant", ["tiny", "hfjson"])
@pytest.mark.parametrize("world", [1, 4])
def test_resume_at_other_degree_continues_the_stream(runs, tok, variant, world):
    _check_continues(runs, variant, world, tok)


@pytest.mark.parametrize("variant", ["tiny", "hfjson"])
def test_same_degree_resume_is_bit_identical(runs, variant):
    for r in range(2):
        a = runs["A"][r][variant]
        assert len(a["after_ref"]) == len(a["after_resumed"]) == J * BATCH
        for ref, got in zip(a["after_ref"], a["after_resumed"]):
            for u, v in zip(ref, got):
                assert torch.equal(u, v)


def test_default_corpus_2_to_4_starts_at_the_unread_documents(runs, tok):
    texts = data.read_jsonl_texts(data.DEFAULT_DATASET_PATH)
    blocks = np.array_split(np.arange(len(texts)), 2)
    bos = tok.bos_id
    remaining, buffers = [], []
    for r in range(2):
        st = runs["A"][r]["default"]["saved_dataset_state"]
        idx = st["sample_idx"]
        ids, _ = _docs_of(
            _tokens(runs["A"][r]["default"]["before"]) + list(st["inputs_buffer"]),
            {d: i for i, d in zip(blocks[r][:idx], _doc_tokens([texts[i] for i in blocks[r][:idx]], tok))},
            bos,
        )
        assert ids == list(blocks[r][:idx])
        remaining += list(blocks[r][idx:])
        buffers.append(list(st["inputs_buffer"]))
    shares = np.array_split(np.array(remaining), 4)
    for t in range(4):
        stream = _tokens(runs[4][t]["default"]["after"])
        _check_positions(runs[4][t]["default"]["after"])
        carried = [x for r in range(2) if r * 4 // 2 == t for x in buffers[r]]
        assert stream[: len(carried)] == carried[: len(stream)]
        rest = stream[len(carried):]
        if not rest:
            continue
        expect = list(shares[t][:40])
        lookup = {d: i for i, d in zip(expect, _doc_tokens([texts[i] for i in expect], tok))}
        ids, partial = _docs_of(rest, lookup, bos, allow_last_partial=True)
        assert ids == expect[: len(ids)]
        if partial is not None:  # the document being read when the batches ended
            nxt = _doc_tokens([texts[expect[len(ids)]]], tok)[0]
            assert nxt[: len(partial)] == partial


def _load_into(dl, ckpt):
    """One rank's load through the manager (in this process, no process group)."""
    mgr = _manager(os.path.dirname(ckpt), dl)
    return mgr.load(step=int(ckpt.rsplit("-", 1)[1]))


def test_restart_starts_over_with_a_warning(runs, tok, caplog):
    ckpt = os.path.join(runs["root"], "ckpt", "tiny", f"step-{STEP}")
    dl = _build("tiny", runs["corpus"], 0, 1, tok, on_dp_change="restart")
    fresh = _build("tiny", runs["corpus"], 0, 1, tok)
    with caplog.at_level(logging.WARNING):
        assert _load_into(dl, ckpt)
    assert any(ON_DP_CHANGE_KEY in r.getMessage() and "starts over" in r.getMessage() for r in caplog.records)
    got, want = _flat([next(iter(dl))]), _flat([next(iter(fresh))])
    for g, w in zip(got, want):
        for u, v in zip(g, w):
            assert torch.equal(u, v)


def test_error_policy_names_the_key(runs, tok):
    ckpt = os.path.join(runs["root"], "ckpt", "tiny", f"step-{STEP}")
    dl = _build("tiny", runs["corpus"], 0, 4, tok, on_dp_change="error")
    with pytest.raises(DataLoaderReshardError, match=r"dataloader\.on_dp_change") as e:
        _load_into(dl, ckpt)
    assert "2 data-parallel ranks" in str(e.value) and "this run has 4" in str(e.value)
    assert dl._load_request is None  # the hook cleaned up


def test_streaming_dataset_continues_and_a_shuffle_buffer_refuses(runs, tok, hf_json):
    """A plain local stream continues at another degree (tests/integration/test_stream_resume.py
    checks it exactly); one shuffled through a buffer has no position to
    continue from and refuses, naming the key, with nothing changed."""
    ckpt = os.path.join(runs["root"], "ckpt", "stream", f"step-{STEP}")
    dl = _build("stream", runs["corpus"], 0, 1, tok)
    assert _load_into(dl, ckpt)
    first = _tokens(_flat([next(iter(dl))]))
    carried = list(runs["A"][0]["stream"]["saved_dataset_state"]["inputs_buffer"])
    assert carried and first[: len(carried)] == carried[: len(first)]

    dl = _build("stream_shuffled", runs["corpus"], 0, 1, tok)
    before = pickle.loads(dl.state_dict()["dp_rank_0"])
    with pytest.raises(DataLoaderReshardError, match=r'dataloader\.on_dp_change = "restart"') as e:
        _load_into(dl, ckpt)
    assert "shuffle" in str(e.value) and "buffer" in str(e.value)
    assert pickle.loads(dl.state_dict()["dp_rank_0"]) == before
    # ... and "restart" is the way through.
    dl = _build("stream_shuffled", runs["corpus"], 0, 1, tok, on_dp_change="restart")
    assert _load_into(dl, ckpt)
    next(iter(dl))


def test_streaming_dataset_same_degree_is_torchtitans(runs, tok, hf_json):
    """Same degree never reshards: the streaming state loads as in torchtitan."""
    ckpt = os.path.join(runs["root"], "ckpt", "stream", f"step-{STEP}")
    md = FileSystemReader(ckpt).read_metadata()
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1"} <= set(md.state_dict_metadata)
    dls = [_build("stream", runs["corpus"], r, 2, tok) for r in range(2)]
    for dl in dls:
        assert _load_into(dl, ckpt)
        assert dl._load_request is None
    for r, dl in enumerate(dls):
        assert "data" in runs["A"][r]["stream"]["saved_dataset_state"]
        it = iter(dl)
        got = _flat([next(it) for _ in range(J)])
        for ref, g in zip(runs["A"][r]["stream"]["after_ref"], got):
            for u, v in zip(ref, g):
                assert torch.equal(u, v)


def test_torchtitan_worker_state_cannot_continue(runs, tok):
    """torchtitan's loader with num_workers > 0 gives every worker the rank's
    whole share of a map-style dataset, so its per-worker positions do not say
    which documents the rank read: a DP change refuses, naming the key."""
    dl = _build("tiny", runs["corpus"], 0, 1, tok)
    position = runs["A"][0]["tiny"]["saved_dataset_state"]  # no worker marker: torchtitan's
    workers = {
        f"worker_{w}": {"worker_id": w, "dataset_state": position,
                        "fetcher_state": {"fetcher_ended": False, "dataset_iter_state": None}}
        for w in range(2)
    }
    worker_state = pickle.dumps({
        "_snapshot": {"_snapshot_step": K, "_last_yielded_worker_id": 1, "_main_snapshot": {},
                      "_worker_snapshots": workers},
        "_steps_since_snapshot": 0, "_iterator_finished": False,
    })
    with pytest.raises(DataLoaderReshardError, match=r"num_workers > 0.*dataloader\.on_dp_change"):
        dl.load_state_dict({"dp_rank_0": worker_state, "dp_rank_1": worker_state, "world_size": 2})
    empty = pickle.dumps({"_snapshot": {}, "_steps_since_snapshot": 0, "_iterator_finished": False})
    with pytest.raises(DataLoaderReshardError, match=r"not one this loader reads.*dataloader\.on_dp_change"):
        dl.load_state_dict({"dp_rank_0": empty, "dp_rank_1": empty, "world_size": 2})


def test_loader_without_the_hook_fails_clearly(runs, tok):
    """dcp.load without prepare_load (e.g. torchtitan's own manager, 2 -> 1):
    the rank gets only its own entry and says how to fix it."""
    ckpt = os.path.join(runs["root"], "ckpt", "tiny", f"step-{STEP}")
    dl = _build("tiny", runs["corpus"], 0, 1, tok)
    with pytest.raises(DataLoaderReshardError, match="GefenCheckpointManager"):
        dcp.load({"dataloader": dl}, checkpoint_id=ckpt)


# ------------------------------------- in-process: epochs, re-resharding ---


def _save_ranks(loaders, path):
    """What ``len(loaders)`` ranks write (each its own key), from one process."""

    class Merged:
        def __init__(self):
            self.sd = {}
            for dl in loaders:
                self.sd.update(dl.state_dict())

        def state_dict(self):
            return self.sd

        def load_state_dict(self, sd):
            raise AssertionError

    shutil.rmtree(path, ignore_errors=True)
    dcp.save({"dataloader": Merged()}, checkpoint_id=path)


def _load_ranks(loaders, path):
    md = FileSystemReader(path).read_metadata()
    for dl in loaders:
        dl.prepare_load("unused", md, prefix="dataloader.")
        try:
            dcp.load({"dataloader": dl}, checkpoint_id=path)
        finally:
            dl.abort_load()


def test_without_a_dp_change_it_is_torchtitans_loader(tmp_path, tok):
    """Same batches and the same state as HuggingFaceTextDataLoader, and each
    loads the other's state (a run can switch loader class at any resume)."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    corpus = _write_corpus(str(tmp_path))
    kw = dict(dp_world_size=2, dp_rank=1, tokenizer=tok, seq_len=SEQ, local_batch_size=BATCH)
    tt = HuggingFaceTextDataLoader.Config(dataset="gefen_tiny", dataset_path=corpus).build(**kw)
    ours = _build("tiny", corpus, 1, 2, tok, infinite=True)
    it_tt, it_ours = iter(tt), iter(ours)
    for _ in range(4):
        (a, b), (c, d) = next(it_tt), next(it_ours)
        assert all(torch.equal(a[k], c[k]) for k in ("input", "positions")) and torch.equal(b, d)
    st_tt, st_ours = tt.state_dict(), ours.state_dict()
    assert st_tt["world_size"] == st_ours["world_size"] == 2
    assert pickle.loads(st_tt["dp_rank_1"]) == pickle.loads(st_ours["dp_rank_1"])
    ref = _flat([next(it_tt) for _ in range(3)])
    for build, state in [
        (lambda: HuggingFaceTextDataLoader.Config(dataset="gefen_tiny", dataset_path=corpus).build(**kw), st_ours),
        (lambda: _build("tiny", corpus, 1, 2, tok, infinite=True), st_tt),
    ]:
        dl = build()
        dl.load_state_dict(state)
        it = iter(dl)
        for r, g in zip(ref, _flat([next(it) for _ in range(3)])):
            assert all(torch.equal(u, v) for u, v in zip(r, g))


def test_block_pass_matches_torchtitans_reading_order(tmp_path, tok):
    corpus = _write_corpus(str(tmp_path))
    texts = _corpus_texts()
    for world, rank, epoch in [(2, 1, 0), (3, 2, 0), (2, 0, 1), (3, 1, 4)]:
        dl = _build("tiny", corpus, rank, world, tok)
        st = pickle.loads(dl.state_dict()[f"dp_rank_{rank}"])
        st["dataset_state"]["epoch"] = epoch
        dl.load_state_dict({f"dp_rank_{rank}": pickle.dumps(st), "world_size": world})
        iter(dl)  # StatefulDataLoader applies a loaded state when iterated
        assert list(dl.dataset._data["text"]) == [texts[i] for i in block_pass(len(texts), world, rank, epoch)]


def test_plan_and_encoding():
    passes = [np.arange(0, 5), np.arange(5, 10)]
    parts = plan_reshard(passes, [2, 4], 3)
    assert [p.tolist() for p in parts] == [[2, 3], [4], [9]]
    parts = plan_reshard([np.array([7, 3, 1]), np.array([0, 2])], [3, 0], 1)
    assert [p.tolist() for p in parts] == [[0, 2]]
    for idx in (np.arange(3, 40), np.array([5, 1, 9, 2]), np.zeros(0, np.int64), np.r_[0:10, 20:30]):
        assert decode_pass(encode_pass(idx, 50)).tolist() == idx.tolist()
    assert "runs" in encode_pass(np.arange(1000), 1000)
    assert "indices" in encode_pass(np.random.default_rng(0).permutation(100), 100)


def test_reshard_twice_then_reloop_on_the_new_layout(tmp_path, tok):
    """2 -> 3 -> 2, saving inside the resharded pass: a same-degree resume
    there is bit-identical, every document is read exactly once over the
    pass, then each rank re-loops onto torchtitan's own layout for its rank
    at the new degree (epoch 1, shuffled)."""
    corpus = _write_corpus(str(tmp_path))
    texts = _corpus_texts()
    docs = _doc_tokens(texts, tok)
    lookup = {d: i for i, d in enumerate(docs)}
    bos = tok.bos_id

    def build(world, ckpt=None):
        dls = [_build("tiny", corpus, r, world, tok, infinite=True) for r in range(world)]
        if ckpt is not None:
            _load_ranks(dls, str(tmp_path / ckpt))
        return dls, [iter(dl) for dl in dls]  # a loaded state applies at iter()

    def take(its, n):
        return [_tokens(_flat([next(it) for _ in range(n)])) for it in its]

    def buffers(dls):
        return [list(dl.dataset._inputs_buffer) for dl in dls]

    def whole_docs(streams, bufs_in, src_world, bufs_out, *, cut=None):
        """Document ids of a stage: carried buffers first, then whole documents."""
        ids = []
        for t, stream in enumerate(streams):
            carried = [x for r in range(src_world) if r * len(streams) // src_world == t for x in bufs_in[r]]
            s = stream + (bufs_out[t] if bufs_out else [])
            assert s[: len(carried)] == carried
            got, _ = _docs_of(s[len(carried):], lookup, bos, allow_last_partial=cut is not None)
            if cut is not None:
                assert len(got) >= cut[t]
                got = got[: cut[t]]
            ids += got
        return ids

    src, its = build(2)
    stream_a = take(its, 4)
    _save_ranks(src, str(tmp_path / "c1"))
    buf_a = buffers(src)

    mid, its = build(3, "c1")
    stream_b = take(its, 3)
    _save_ranks(mid, str(tmp_path / "c2"))
    buf_b = buffers(mid)
    again, its2 = build(3, "c2")
    for dl in again:
        assert dl.dataset._pass is not None
    for x, y in zip(take(its, 3), take(its2, 3)):
        assert x == y  # same degree inside the resharded pass: identical

    dst, its = build(2, "c2")
    owed = [len(dl.dataset._pass) for dl in dst]
    assert sum(owed) > 0
    stream_c = []
    for dl, it in zip(dst, its):  # to the end of the pass: until it re-loops
        toks = []
        while dl.dataset._epoch == 0:
            toks += _tokens(_flat([next(it)]))
        stream_c.append(toks)

    ids = [i for r in range(2) for i in _docs_of(stream_a[r] + buf_a[r], lookup, bos)[0]]
    ids += whole_docs(stream_b, buf_a, 2, buf_b)
    ids += whole_docs(stream_c, buf_b, 3, None, cut=owed)
    assert collections.Counter(ids) == collections.Counter(range(len(docs)))

    for r, dl in enumerate(dst):  # next epoch: torchtitan's layout at 2 ranks
        assert dl.dataset._pass is None and dl.dataset._epoch == 1
        assert list(dl.dataset._data["text"]) == [texts[i] for i in block_pass(len(texts), 2, r, 1)]
        assert PASS_KEY not in pickle.loads(dl.state_dict()[f"dp_rank_{r}"])["dataset_state"]


def test_lift_dataloader_config():
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    base = llama3_debugmodel().dataloader
    assert type(base) is HuggingFaceTextDataLoader.Config
    base.dataset, base.infinite, base.num_workers = "gefen_tiny", False, 0
    lifted = lift_dataloader_config(base)
    assert type(lifted) is ElasticTextDataLoader.Config
    assert (lifted.dataset, lifted.infinite, lifted.on_dp_change) == ("gefen_tiny", False, "continue")
    assert lift_dataloader_config(lifted) is lifted
    other = object()
    assert lift_dataloader_config(other) is other
    with pytest.raises(ValueError, match=r"dataloader\.on_dp_change"):
        ElasticTextDataLoader.Config(on_dp_change="again")
