"""Resume the global-order data loader at another DP size through the real
checkpoint managers and DCP, on real gloo ranks (gefen_titan/data/global_loader.py).

  reference, N = 2, 3, 4 ranks: read K steps (gradient accumulation as the
      trainer does it), save at step K through GefenCheckpointManager, read J
      more steps: the uninterrupted run;
  resume, M ranks: load step K of the N-rank checkpoint, read J steps.

For 2 -> 4, 4 -> 2, 2 -> 1, 3 -> 2 (and 2 -> 2), every global batch after the
resume must hold exactly the samples (tokens, labels, positions) of the
uninterrupted run's batch at the same step. The global batch is 12 samples
and the local batch differs by size, so the number of microbatches a step
differs too (dp 1: 4, 2: 2, 3: 2, 4: 1). The resumed reads cross an epoch
boundary. 4 -> 2 is also loaded through torchtitan's own CheckpointManager:
the state is one replicated position, so it needs none of our hooks.
"""

from __future__ import annotations

import collections
import json
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.data import corpus as data
from gefen_titan.data.global_loader import GlobalOrderDataLoader
from tests.helpers import processes

SEQ, G, K, J = 32, 12, 3, 4  # seq_len, global batch, steps before the save, steps after
LOCAL = {1: 3, 2: 3, 3: 2, 4: 3}  # microbatches a step: 4, 2, 2, 1
PAIRS = [(2, 4), (4, 2), (2, 1), (3, 2), (2, 2)]
PLAIN = (4, 2)  # also through torchtitan's CheckpointManager


def _texts():
    rng = random.Random(11)
    words = "red green blue cyan magenta yellow black white grey".split()
    return [f"Note {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 45))) for i in range(30)]


class _Blob:
    """Stand-in optimizer / LR scheduler state for the checkpoint manager."""

    def state_dict(self):
        return {"blob": torch.zeros(1)}

    def load_state_dict(self, sd):
        pass


def _manager(folder, dataloader, plain=False):
    from torchtitan.components.checkpoint import CheckpointManager

    cls = CheckpointManager if plain else GefenCheckpointManager
    cfg = cls.Config(enable=True, folder=folder, interval=1, keep_latest_k=0, last_save_model_only=False)
    torch.manual_seed(0)
    return cfg.build(dataloader=dataloader, model_parts=[nn.Linear(2, 2)], optimizers=_Blob(),
                     lr_schedulers=_Blob(), states={}, sd_adapter=None, base_folder="")


def _loader(root, world, rank):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)
    return GlobalOrderDataLoader.Config(dataset_path=os.path.join(root, "ds")).build(
        dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ, local_batch_size=LOCAL[world])


def _steps(dl, it, n):
    """n trainer steps: G // (local x dp) microbatches each; this rank's rows per step."""
    accum = G // (dl.local_batch_size * dl.dp_world_size)
    out = []
    for _ in range(n):
        xs, ys, ps = [], [], []
        for _ in range(accum):
            x, y = next(it)
            xs.append(x["input"])
            ys.append(y)
            ps.append(x["positions"])
        out.append((torch.cat(xs), torch.cat(ys), torch.cat(ps)))
    return out


def _init(rank, world, root, tag):
    dist.init_process_group("gloo", init_method=f"file://{root}/store_{tag}", rank=rank, world_size=world)


def _reference(rank, world, root):
    _init(rank, world, root, f"ref{world}")
    try:
        dl = _loader(root, world, rank)
        it = iter(dl)
        before = _steps(dl, it, K)
        mgr = _manager(os.path.join(root, f"ckpt{world}"), dl)
        mgr.save(curr_step=K)
        after = _steps(dl, it, J)
        mgr.close()
        torch.save({"before": before, "after": after}, os.path.join(root, f"ref{world}_{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _resume(rank, world, root, sources):
    _init(rank, world, root, f"res{world}")
    try:
        out = {}
        for src, plain in sources:
            dl = _loader(root, world, rank)
            mgr = _manager(os.path.join(root, f"ckpt{src}"), dl, plain=plain)
            assert mgr.load(step=K)
            out[(src, plain)] = _steps(dl, iter(dl), J)
            mgr.close()
            dist.barrier()
        torch.save(out, os.path.join(root, f"res{world}_{rank}.pt"))
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
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from gefen_titan.data.indexed_build import build_indexed_dataset

    root = str(tmp_path_factory.mktemp("global_resume"))
    corpus = os.path.join(root, "corpus.jsonl")
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in _texts())
    tok = HuggingFaceTokenizer(tokenizer_path=data.DEFAULT_TOKENIZER_PATH)
    build_indexed_dataset([corpus], tok, os.path.join(root, "ds"), progress=False)

    sources = collections.defaultdict(list)
    for n, m in PAIRS:
        sources[m].append((n, False))
    sources[PLAIN[1]].append((PLAIN[0], True))
    for n in sorted({n for n, _ in PAIRS}):
        _start(_reference, (n, root), n)
    for m in sorted(sources):
        _start(_resume, (m, root, sources[m]), m)
    def load(name):
        return torch.load(os.path.join(root, name), weights_only=False)

    ref = {n: [load(f"ref{n}_{r}.pt") for r in range(n)] for n in sorted({n for n, _ in PAIRS})}
    res = {m: [load(f"res{m}_{r}.pt") for r in range(m)] for m in sorted(sources)}
    return root, ref, res


def _global(per_rank_steps, step):
    """The multiset of (input, label, positions) rows all ranks read in one step."""
    rows = collections.Counter()
    for steps in per_rank_steps:
        x, y, p = steps[step]
        rows.update(zip(map(tuple, x.tolist()), map(tuple, y.tolist()), map(tuple, p.tolist())))
    return rows


def test_the_reads_cross_an_epoch_and_the_reference_runs_agree(runs):
    root, ref, _ = runs
    dl = _loader(root, 1, 0)
    assert K * G < dl.order.samples_per_epoch < (K + J) * G  # the resumed reads start the next epoch
    # The uninterrupted runs already read the same global batches at 2, 3 and 4 ranks.
    for n in ref:
        for step in range(K):
            assert _global([r["before"] for r in ref[n]], step) == _global([r["before"] for r in ref[2]], step)
        for step in range(J):
            assert _global([r["after"] for r in ref[n]], step) == _global([r["after"] for r in ref[2]], step)
    assert sum(_global([r["after"] for r in ref[2]], 0).values()) == G


@pytest.mark.parametrize("pair", PAIRS + [PLAIN + ("torchtitan",)],
                         ids=lambda p: f"{p[0]}->{p[1]}" + (" plain" if len(p) > 2 else ""))
def test_resume_reads_the_uninterrupted_runs_global_batches(runs, pair):
    _, ref, res = runs
    n, m = pair[:2]
    plain = len(pair) > 2
    resumed = [r[(n, plain)] for r in res[m]]
    for step in range(J):
        want = _global([r["after"] for r in ref[n]], step)
        assert _global(resumed, step) == want, f"{n}->{m}: global batch {K + 1 + step} differs"


def test_checkpoint_holds_one_global_position(runs):
    root, _, _ = runs
    for n in (2, 3, 4):
        md = FileSystemReader(os.path.join(root, f"ckpt{n}", f"step-{K}")).read_metadata()
        keys = sorted(k for k in md.state_dict_metadata if k.startswith("dataloader."))
        assert "dataloader.global_order.consumed_samples" in keys
        assert not [k for k in keys if "dp_rank" in k or k == "dataloader.world_size"]
