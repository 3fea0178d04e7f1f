"""Elastic resume of streaming datasets (issue 12; gefen_titan/data/stream_reshard.py).

Real gloo ranks read a local multi-file corpus through ``gefen_tiny_stream``
(``load_dataset("json", streaming=True)``, one shard per file) and save and
load through ``GefenCheckpointManager``. Each save/resume pair N -> M runs
four variants: 12 files (they divide 1..4 ranks: whole files per rank) or 5
(they divide none: every N-th document), and 0 or 2 DataLoader workers on
either side:

  source, N ranks:  read K batches per reading unit (rank or worker), save;
  stage,  M ranks:  load, read one batch per unit, save inside the resharded
                    pass, read J more (reference); a fresh loader resumes that
                    save at the same layout and must give the same J batches;
  final,  M ranks:  read the rest of the pass (with workers: resumed with
                    none, a worker-count change within each rank).

Batches are attributed to units by torchdata's round robin (each unit has
more than one batch here). Each unit's token stream (what it yielded + the
buffer it saved) must be: the buffers carried to it, in source order, then
whole documents. Across the three stages every document of the corpus
occurs exactly once, and the token multiset is the corpus's: the pass is
read once, no repeats, no gaps. At N = 2 the source also checks that the
loader is torchtitan's (same batches) and that a same-size resume is
bit-identical to torchtitan's uninterrupted loader.

Launches: 2 ranks (source), 4 (source; 2 -> 4), 3 (4 -> 3; source), 2
(3 -> 2; a stream that cannot continue, refused on both ranks); 2 -> 1 runs
in this process. The rest (4 -> 2 into the next epoch,
replay of batches read since a worker snapshot, refusals, the partition and
the contracts on datasets / torchdata internals) runs here too.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import pickle
import random
import re
from importlib.metadata import version

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from gefen_titan import patches
from gefen_titan.data import corpus as data
from gefen_titan.data import stream as stream_data
from gefen_titan.data.elastic import ElasticTextDataLoader
from gefen_titan.data.elastic_dataset import STREAM_KEY, DataLoaderReshardError
from gefen_titan.data.loader_state import read_saved_loader
from gefen_titan.data.stream_reshard import advance_filters, as_worker, unit_shares
from tests.helpers import processes
from tests.helpers.loader_checkpoint import manager as _manager

# Rank processes import this module, not conftest: what train.py does first.
patches.apply_all()
data.register_datasets()

SEQ, B, K, J = 32, 2, 2, 2  # seq_len, local batch, batches per unit before a save, batches compared after
N_DOCS = 120
VARIANTS = {  # name -> (files, source workers, destination workers)
    "f12_w0_w0": (12, 0, 0),
    "f5_w0_w2": (5, 0, 2),
    "f12_w2_w2": (12, 2, 2),
    "f5_w2_w0": (5, 2, 0),
}
PAIRS = [(2, 1), (2, 4), (4, 3), (3, 2)]

# ---------------------------------------------------------------- fixtures ---


def _texts() -> list[str]:
    rng = random.Random(12)
    words = "alpha beta gamma delta epsilon zeta theta lambda sigma omega list dict tuple".split()
    return [
        f"Document {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 45))) + "."
        for i in range(N_DOCS)
    ]


def _write_corpora(root: str) -> None:
    texts = _texts()
    for files in {f for f, _, _ in VARIANTS.values()}:
        d = os.path.join(root, f"corpus{files}")
        os.makedirs(d)
        for k in range(files):
            with open(os.path.join(d, f"part-{k:02d}.jsonl"), "w") as f:
                for t in texts[k * N_DOCS // files:(k + 1) * N_DOCS // files]:
                    f.write(json.dumps({"text": t}) + "\n")


def _tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)


def _build(root, files, rank, world, workers, tok, *, infinite=False, snapshot_every_n_steps=1, cls=None):
    cls = cls or ElasticTextDataLoader
    cfg = cls.Config(dataset="gefen_tiny_stream", dataset_path=os.path.join(root, f"corpus{files}"),
                     infinite=infinite, num_workers=workers)
    return cfg.build(dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ, local_batch_size=B,
                     snapshot_every_n_steps=snapshot_every_n_steps)




def _samples(batches):
    return [(x["input"][i], y[i], x["positions"][i]) for x, y in batches for i in range(x["input"].shape[0])]


def _tokens(batches):
    return [int(t) for x, _ in batches for t in x["input"].flatten().tolist()]


def _same(a, b) -> bool:
    a, b = _samples(a), _samples(b)
    return len(a) == len(b) and all(all(torch.equal(u, v) for u, v in zip(p, q)) for p, q in zip(a, b))


def _positions_ok(batches) -> bool:
    return all(int(p.min()) >= 0 and int(p.max()) < SEQ for _, _, p in _samples(batches))


def _units(batches, saved, workers):
    """[(tokens yielded, buffer saved)] per unit; batch j came from unit j % W."""
    n = max(workers, 1)
    return [
        (_tokens(batches[w::n]), list(saved.dataset_states[w]["inputs_buffer"])) for w in range(n)
    ]


def _saved(dl):
    return read_saved_loader(pickle.loads(dl.state_dict()[f"dp_rank_{dl.dp_rank}"]))


# -------------------------------------------------------------- the phases ---


def _source(root, rank, world, tok):
    out = {}
    for name, (files, workers, _) in VARIANTS.items():
        dl = _build(root, files, rank, world, workers, tok)
        it = iter(dl)
        batches = [next(it) for _ in range(K * max(workers, 1))]
        mgr = _manager(os.path.join(root, "ckpt", f"src{world}", name), dl)
        mgr.save(curr_step=1)
        mgr.close()
        res = {"units": _units(batches, _saved(dl), workers), "positions_ok": _positions_ok(batches)}
        if world == 2:  # torchtitan's loader, uninterrupted, and our same-size resume
            from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

            tt = _build(root, files, rank, world, workers, tok, cls=HuggingFaceTextDataLoader)
            ref = list(itertools.islice(iter(tt), len(batches) + J))
            again = _build(root, files, rank, world, workers, tok)
            assert _manager(os.path.join(root, "ckpt", f"src{world}", name), again).load(step=1)
            res["is_torchtitans"] = _same(batches, ref[: len(batches)])
            res["resume_is_torchtitans"] = _same(list(itertools.islice(iter(again), J)), ref[len(batches):])
            del tt, again
        out[name] = res
        del it, dl
    return out


def _destination(root, rank, world, src_world, tok):
    out = {}
    for name, (files, _, workers) in VARIANTS.items():
        dl = _build(root, files, rank, world, workers, tok)
        assert _manager(os.path.join(root, "ckpt", f"src{src_world}", name), dl).load(step=1)
        it = iter(dl)
        stage = [next(it) for _ in range(max(workers, 1))]
        folder = os.path.join(root, "ckpt", f"{src_world}to{world}", name)
        mgr = _manager(folder, dl)
        mgr.save(curr_step=2)
        mgr.close()
        saved = _saved(dl)
        ref = list(itertools.islice(it, J))
        del it, dl

        again = _build(root, files, rank, world, workers, tok)
        assert _manager(folder, again).load(step=2)
        it = iter(again)
        resumed = list(itertools.islice(it, J))
        if workers:  # the rest without workers: a worker-count change within the rank
            del it, again
            final = _build(root, files, rank, world, 0, tok)
            assert _manager(folder, final).load(step=2)
            rest = list(final)
        else:
            final, rest = again, resumed + list(it)
        out[name] = {
            "stage": _units(stage, saved, workers),
            "in_pass": all(STREAM_KEY in s for s in saved.dataset_states),
            "same_layout_resume": _same(ref, resumed) and len(ref) == J,
            "final": (_tokens(rest), list(final.dataset._inputs_buffer)),
            "positions_ok": _positions_ok(stage + ref + rest),
        }
        del final
    return out


def _register_mapped_stream():
    """A stream built with .map: its state is not known to resume exactly."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS["mapped_stream"] = DatasetConfig(
        path="", sample_processor=lambda s: s["text"],
        loader=lambda p: stream_data.load_stream(p).map(lambda x: {"text": x["text"]}),
    )


def _refusal(root, rank, world, tok):
    """Every rank refuses the same way, before its state changes (no rank
    goes on to a collective the others never reach)."""
    _register_mapped_stream()
    dl = ElasticTextDataLoader.Config(
        dataset="mapped_stream", dataset_path=os.path.join(root, "corpus12"), infinite=False,
    ).build(dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ, local_batch_size=B)
    before = pickle.loads(dl.state_dict()[f"dp_rank_{rank}"])
    try:
        _manager(os.path.join(root, "ckpt", "src3", "f12_w0_w0"), dl).load(step=1)
        message = None
    except DataLoaderReshardError as e:
        message = str(e)
    return {"message": message, "unchanged": pickle.loads(dl.state_dict()[f"dp_rank_{rank}"]) == before}


def _phase(rank, world, root, jobs):
    import multiprocessing

    # DataLoader workers fork from the rank, as under torchrun (a rank started
    # by the forkserver would otherwise start them through it, and hang).
    multiprocessing.set_start_method("fork", force=True)
    dist.init_process_group("gloo", init_method=f"file://{root}/store_{world}_{jobs[0]}", rank=rank,
                            world_size=world)
    try:
        tok = _tokenizer()
        for job in jobs:
            if job == "src":
                res = _source(root, rank, world, tok)
            elif job == "refuse":
                res = _refusal(root, rank, world, tok)
            else:
                res = _destination(root, rank, world, job, tok)
            torch.save(res, os.path.join(root, f"{job}_{world}_{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


# A launch takes well under a minute here; a hung one fails, its ranks killed.
LAUNCH_TIMEOUT_S = 600


def _start(jobs, nprocs, root):
    """Real processes, forked from the session's fork server; killed if the wait ends early."""
    processes.spawn(_phase, (nprocs, root, jobs), nprocs, timeout=LAUNCH_TIMEOUT_S, fork_server=True)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tok):
    root = str(tmp_path_factory.mktemp("stream_resume"))
    _write_corpora(root)
    _start(["src"], 2, root)
    _start(["src", 2], 4, root)
    _start([4, "src"], 3, root)
    _start([3, "refuse"], 2, root)
    res = {"root": root, ("dst", 2, 1): [_destination(root, 0, 1, 2, tok)]}
    def load(name):
        return torch.load(os.path.join(root, name), weights_only=False)

    for n in (2, 4, 3):
        res[("src", n)] = [load(f"src_{n}_{r}.pt") for r in range(n)]
    for n, m in PAIRS[1:]:
        res[("dst", n, m)] = [load(f"{n}_{m}_{r}.pt") for r in range(m)]
    res["refuse"] = [load(f"refuse_2_{r}.pt") for r in range(2)]
    return res


# ------------------------------------------------------- stream accounting ---


def _doc_tokens(tok):
    return [tuple(tok.encode(t, add_bos=True, add_eos=True)[:-1]) for t in _texts()]


def _whole_docs(stream, lookup, bos):
    """Document ids of a stream that must be whole documents back to back."""
    starts = [i for i, t in enumerate(stream) if t == bos]
    assert not stream or (starts and starts[0] == 0), "stream does not start at a document"
    bounds = starts + [len(stream)]
    pieces = [tuple(stream[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert all(p in lookup for p in pieces), "a piece of the stream is not a whole document"
    return [lookup[p] for p in pieces]


def _after(stream, carried):
    assert stream[: len(carried)] == carried, "the unit does not start with the buffers carried to it"
    return stream[len(carried):]


def _check_pass_read_once(src, dst, dst_workers, tok):
    """``src``: [(yielded, saved buffer)] per source unit (rank-major);
    ``dst``: per new rank, its stage units and its final stream. The whole
    corpus must be read exactly once, each unit starting with the buffers
    carried to it."""
    docs = _doc_tokens(tok)
    assert len(set(docs)) == len(docs)
    lookup = {d: i for i, d in enumerate(docs)}
    bos = tok.bos_id
    stage = [u for d in dst for u in d["stage"]]
    assert all(len(d["stage"]) == max(dst_workers, 1) for d in dst)
    assert all(d["positions_ok"] and d["in_pass"] for d in dst)
    assert any(buf for _, buf in src), "the scenario should carry partly read buffers"

    read = []
    for yielded, buf in src:  # the source units, from their first document
        read += _whole_docs(yielded + buf, lookup, bos)
    for v, (yielded, buf) in enumerate(stage):  # carried buffers first: unit u's goes to u * V // U
        carried = [x for u, (_, b) in enumerate(src) if u * len(stage) // len(src) == v for x in b]
        read += _whole_docs(_after(yielded + buf, carried), lookup, bos)
    for d in dst:  # the rest of the pass: the rank's stage buffers, in order, first
        carried = [x for _, b in d["stage"] for x in b]
        tokens, leftover = d["final"]
        read += _whole_docs(_after(tokens + leftover, carried), lookup, bos)

    assert collections.Counter(read) == collections.Counter(range(N_DOCS)), "documents repeated or missing"
    yielded_tokens = [x for y, _ in src for x in y] + [x for y, _ in stage for x in y]
    yielded_tokens += [x for d in dst for part in d["final"] for x in part]
    assert collections.Counter(yielded_tokens) == collections.Counter(x for d in docs for x in d)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}to{p[1]}")
def test_the_pass_is_read_once_across_the_resume(runs, tok, pair, variant):
    src_world, dst_world = pair
    _, src_workers, dst_workers = VARIANTS[variant]
    sources = runs[("src", src_world)]
    assert all(sources[r][variant]["positions_ok"] for r in range(src_world))
    src = [u for r in range(src_world) for u in sources[r][variant]["units"]]
    assert len(src) == src_world * max(src_workers, 1)
    dst = [runs[("dst", src_world, dst_world)][t][variant] for t in range(dst_world)]
    _check_pass_read_once(src, dst, dst_workers, tok)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_same_layout_resumes_are_bit_identical(runs, variant):
    for r in range(2):  # our loader is torchtitan's, and so is its same-size resume
        res = runs[("src", 2)][r][variant]
        assert res["is_torchtitans"] and res["resume_is_torchtitans"]
    for pair in PAIRS:  # inside a resharded pass, with or without workers
        assert all(d[variant]["same_layout_resume"] for d in runs[("dst", *pair)])


# ------------------------------------------------ in-process: next epoch ---


def _load_ranks(loaders, path):
    md = FileSystemReader(path).read_metadata()
    for dl in loaders:
        dl.prepare_load("unused", md, prefix="dataloader.")
        try:
            dcp.load({"dataloader": dl}, checkpoint_id=path)
        finally:
            dl.abort_load()


def test_after_the_pass_it_is_torchtitans_layout_at_the_new_size(runs, tok):
    """4 -> 2 (12 files, no workers), infinite: when a rank has read its share
    it re-loops onto torchtitan's split_dataset_by_node(ds, t, 2) in the next
    epoch, from its start."""
    from datasets.distributed import split_dataset_by_node

    root = runs["root"]
    ckpt = os.path.join(root, "ckpt", "src4", "f12_w0_w0", "step-1")
    loaders = [_build(root, 12, t, 2, 0, tok, infinite=True) for t in range(2)]
    _load_ranks(loaders, ckpt)
    full = stream_data.load_stream(os.path.join(root, "corpus12"))
    for t, dl in enumerate(loaders):
        it = iter(dl)
        next(it)  # a loaded state applies at iter()
        assert dl.dataset._stream is not None
        while dl.dataset._stream is not None:
            next(it)
        expect = split_dataset_by_node(full, t, 2)
        expect.set_epoch(1)
        positions = []  # torchtitan's rank t of 2, epoch 1: its state after each document
        for _ in expect:
            positions.append(expect.state_dict())
        state = dl.dataset.state_dict()
        assert STREAM_KEY not in state and state["data"]["epoch"] == 1
        k = positions.index(state["data"])
        for _ in range(3):
            next(it)
        assert positions.index(dl.dataset.state_dict()["data"]) > k


# ------------------------------------- in-process: map-style with workers ---


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

    dcp.save({"dataloader": Merged()}, checkpoint_id=path)


def _build_map(path, rank, world, workers, tok):
    cfg = ElasticTextDataLoader.Config(dataset="gefen_tiny", dataset_path=path, infinite=False, num_workers=workers)
    return cfg.build(dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ, local_batch_size=B)


def test_map_style_with_workers_reads_the_pass_once(tmp_path, tok):
    """Map-style data (gefen_tiny on a JSONL file) with 2 workers per rank:
    each worker reads every 2nd document of its rank's pass (torchtitan's
    workers each read all of it). 2 ranks x 2 workers saved, resumed at 3
    ranks without workers, and at 1 rank with 2 workers (a same-layout
    resume inside that pass is bit-identical), then without."""
    corpus = str(tmp_path / "corpus.jsonl")
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in _texts())
    src, units = [_build_map(corpus, r, 2, 2, tok) for r in range(2)], []
    for dl in src:
        batches = list(itertools.islice(iter(dl), 2 * K))
        units += _units(batches, _saved(dl), 2)
    _save_ranks(src, str(tmp_path / "c1"))
    del src, dl

    wide = [_build_map(corpus, t, 3, 0, tok) for t in range(3)]  # 2 x 2 -> 3 x 0
    _load_ranks(wide, str(tmp_path / "c1"))
    records = []
    for dl in wide:
        it = iter(dl)
        stage = [next(it)]
        buf, in_pass = list(dl.dataset._inputs_buffer), dl.dataset._pass is not None
        rest = list(it)
        records.append({"stage": [(_tokens(stage), buf)], "final": (_tokens(rest), list(dl.dataset._inputs_buffer)),
                        "in_pass": in_pass, "positions_ok": _positions_ok(stage + rest)})
    _check_pass_read_once(units, records, 0, tok)

    one = _build_map(corpus, 0, 1, 2, tok)  # 2 x 2 -> 1 x 2 -> 1 x 0
    _load_ranks([one], str(tmp_path / "c1"))
    it = iter(one)
    stage = [next(it) for _ in range(2)]
    _save_ranks([one], str(tmp_path / "c2"))
    saved = _saved(one)
    ref = list(itertools.islice(it, J))
    del it, one
    again = _build_map(corpus, 0, 1, 2, tok)
    _load_ranks([again], str(tmp_path / "c2"))
    assert _same(ref, list(itertools.islice(iter(again), J))) and len(ref) == J
    del again
    final = _build_map(corpus, 0, 1, 0, tok)
    _load_ranks([final], str(tmp_path / "c2"))
    rest = list(final)
    record = {"stage": _units(stage, saved, 2), "final": (_tokens(rest), list(final.dataset._inputs_buffer)),
              "in_pass": all("elastic_pass" in s for s in saved.dataset_states),
              "positions_ok": _positions_ok(stage + rest)}
    _check_pass_read_once(units, [record], 2, tok)


# ----------------------------------------- in-process: replay, refusals ---


@pytest.mark.parametrize("kind", ["stream", "map"])
def test_batches_read_since_a_worker_snapshot_are_replayed(runs, tmp_path, tok, kind):
    """With workers, torchdata saves the workers' states at the last snapshot
    plus how many batches were read since. A reshard rebuilds where each
    worker really was: the same states as a loader that snapshots every step."""
    from gefen_titan.data.loader_state import BATCH_SIZE_KEY

    root = runs["root"]
    if kind == "stream":
        def build(rank=1, world=2, **kw):
            return _build(root, 5, rank, world, 2, tok, **kw)
    else:
        corpus = str(tmp_path / "corpus.jsonl")
        with open(corpus, "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in _texts())

        def build(rank=1, world=2, **kw):
            return ElasticTextDataLoader.Config(
                dataset="gefen_tiny", dataset_path=corpus, infinite=False, num_workers=2,
            ).build(dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ, local_batch_size=B, **kw)
    states = []
    for every in (1, 3):
        dl = build(snapshot_every_n_steps=every)
        list(itertools.islice(iter(dl), 5))
        states.append(pickle.loads(dl.state_dict()["dp_rank_1"]))
        del dl
    exact, lazy = states
    assert read_saved_loader(exact).steps_since_snapshot == 0 < read_saved_loader(lazy).steps_since_snapshot
    probe = build()
    replayed = [u.state for u in probe._source_units(lazy, 2, 1)]
    assert replayed == [u.state for u in probe._source_units(exact, 2, 1)]
    # A torchtitan loader does not save its batch size: no replay, a clear refusal.
    del lazy[BATCH_SIZE_KEY]
    entries = {"dp_rank_0": pickle.dumps(exact), "dp_rank_1": pickle.dumps(lazy), "world_size": 2}
    single = build(rank=0, world=1)
    with pytest.raises(DataLoaderReshardError, match=r"batch size.*dataloader\.on_dp_change"):
        single.load_state_dict(entries)


def test_a_mapped_stream_refuses_on_every_rank_naming_the_key(runs):
    """3 -> 2 on gloo ranks: both refuse with the same message, nothing changed."""
    got = runs["refuse"]
    assert got[0]["message"] is not None and got[0]["message"] == got[1]["message"]
    assert re.search(r'MappedExamplesIterable.*dataloader\.on_dp_change = "restart"', got[0]["message"])
    assert "3 -> 2 data-parallel ranks" in got[0]["message"]
    assert all(g["unchanged"] for g in got)


# ----------------------------------------------------- partition, contracts ---


def test_unit_shares_partition_every_source_stream():
    for src_units, dst_units in [(2, 1), (2, 4), (4, 3), (3, 2), (4, 6), (5, 7), (1, 3), (6, 6)]:
        got = collections.Counter()
        for dst in range(dst_units):
            for u, lo, hi in unit_shares(src_units, dst_units, dst):
                got.update((u, r) for r in range(lo, hi))
        assert got == collections.Counter((u, r) for u in range(src_units) for r in range(dst_units))


def test_nested_filters_partition_a_stream():
    """A stream split 3 ways, then each part 2 ways: every example exactly once."""
    owners = collections.Counter()
    for first in range(3):
        for second in range(2):
            filters = [[3, first, first + 1, 0], [2, second, second + 1, 0]]
            owners.update(i for i in range(100) if advance_filters(filters))
    assert owners == collections.Counter(range(100))


def test_pinned_internals_of_datasets_torch_and_torchdata(runs):
    """What stream_reshard and loader_state reach into: fail here first."""
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    assert version("datasets") == "4.7.0", "stream_reshard.py was written against datasets 4.7.0"
    assert version("torchdata").split("+")[0] == "0.11.0", "loader_state.py was written against torchdata 0.11.0"
    full = stream_data.load_stream(os.path.join(runs["root"], "corpus5"))
    assert type(full._ex_iterable).__name__ in {"ArrowExamplesIterable", "ExamplesIterable"}
    ds = split_dataset_by_node(full, 1, 2)
    dl = StatefulDataLoader(ds, batch_size=1, num_workers=2)
    real = [b["text"][0] for b in dl]
    state = dl.state_dict()
    assert set(state["_snapshot"]["_worker_snapshots"]) == {"worker_0", "worker_1"}
    assert "dataset_state" in state["_snapshot"]["_worker_snapshots"]["worker_0"]
    emulated = []
    for w in range(2):  # what worker w read, replayed in this process
        it = iter(split_dataset_by_node(full, 1, 2))
        with as_worker(w, 2):
            first = next(it)
        emulated.append([first["text"]] + [x["text"] for x in it])
    assert sorted(real) == sorted(emulated[0] + emulated[1]) and len(real) == N_DOCS // 2
    assert real[:4] == [emulated[0][0], emulated[1][0], emulated[0][1], emulated[1][1]]
