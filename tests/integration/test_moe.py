"""Mixture-of-experts layouts: Gefen and GefenMuon on grouped experts, identical at every layout, resharded exactly.

torchtitan's own Qwen3 MoE model, small, sharded by torchtitan 0.3.0's own
code on gloo (``moe_worker.py``: TP and EP by the model's ``parallelize``,
EP's ``Shard(0)`` over experts, FSDP on efsdp with ``Shard(0)`` or, when
efsdp x ep > experts, ``Shard(1)``; pipeline stages), GefenMuon for the
experts' ``w1``/``w3`` (one Muon matrix per expert) and the attention's
``wo``, Gefen for the rest (the experts' ``w2`` too), every layout fed
bit-identical global gradients:

* layout invariance: parameters and every checkpoint entry bit-identical at
  1 rank, EP 2, EP 1 x FSDP 2, TP 2, PP 2, EP 2 x efsdp 2, EP 4, EP 2 x TP 2,
  PP 2 x EP 2, HSDP 2 x EP 2, and with the experts' rows cut (efsdp
  ``Shard(1)``, with and without EP);
* the reshards of issue 36 through GefenCheckpointManager: EP 2 -> EP 1 at 2
  ranks, EP 2 -> 1 rank, EP 1 -> EP 2, EP 2 x efsdp 2 -> EP 4 and -> EP 2 at 2
  ranks, EP 2 -> EP 2 x TP 2, EP 2 -> PP 2 x EP 2 -> EP 2, ``Shard(1)`` ->
  ``Shard(0)`` and -> 1 rank: the loaded state is the saved one, and the
  parameters 2 steps later equal the uninterrupted run at the target layout,
  bit for bit;
* GefenMuon's schedule: an expert a rank holds whole is orthogonalized by
  that rank (no exchange); cut experts go to one of their holders.

The jobs are ``tests.helpers.moe_runs``'s plan: four launches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.moe_runs import PAIRS, RUNS, experts, target

EXPERTS = "layers.{}.moe.routed_experts.inner_experts.{}"


def load(out: Path, tag: str) -> list[dict]:
    ranks = sorted(out.glob(f"{tag}_r[0-9]*.pt"), key=lambda p: int(p.stem.rsplit("_r", 1)[1]))
    assert ranks, f"no dumps of {tag}"
    return [torch.load(p, weights_only=False) for p in ranks]


@pytest.fixture(scope="module")
def moe(moe_launch) -> Path:
    """Every job of ``moe_runs.plan`` (conftest's ``moe_launch``): their outputs."""
    return moe_launch


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


# Keys that name a pipeline stage's optimizer (by its first parameter): compared through ``records``.
_PER_STAGE = ("gefen/optimizer/", "gefen/codebook/", "gefen/muon/", "gefen/muon_codebook/")


def merged(ranks: list[dict], pick) -> dict:
    """What the ranks dumped of a run (global tensors), over every pipeline stage: the ranks that
    dump an entry must agree on it."""
    out: dict = {}
    for r in ranks:
        for k, v in pick(r).items():
            if k in out:
                assert _same(out[k], v), f"ranks disagree on {k}"
            out[k] = v
    return out


def state(ranks: list[dict], src: str | None = None) -> dict:
    part = (lambda r: r["ref"]["state"]) if src is None else (lambda r: r["resume"][src]["state"])
    return merged(ranks, lambda r: {k: v for k, v in part(r).items() if k != "schedule"})


def params(ranks: list[dict], src: str | None = None) -> dict:
    part = (lambda r: r["ref"]["params"]) if src is None else (lambda r: r["resume"][src]["params"])
    return merged(ranks, lambda r: {(s, n): p for s, ps in part(r).items() for n, p in ps.items()})


def records(st: dict) -> dict:
    return {rec["fqn"]: (key.split("/")[1], rec) for key, value in st.items()
            if key.startswith(("gefen/optimizer/", "gefen/muon/")) for rec in json.loads(value)["params"]}


def codebooks(st: dict) -> dict[str, torch.Tensor]:
    """The job's one codebook of each family: every stage's copy must be it."""
    out = {}
    for family in ("gefen/codebook/", "gefen/muon_codebook/"):
        books = [v for k, v in st.items() if k.startswith(family)]
        assert books and all(torch.equal(books[0], b) for b in books[1:]), family
        out[family] = books[0]
    return out


def differences(a: dict, b: dict) -> list[str]:
    bad = [f for f, book in codebooks(a).items() if not torch.equal(book, codebooks(b)[f])]
    if records(a) != records(b):
        bad.append("records")
    return bad + [k for k in sorted(set(a) | set(b)) if not k.startswith(_PER_STAGE) and not _same(a.get(k), b.get(k))]


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("tag, placements", [
    ("ep2_e4", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
    ("fsdp2_e4", "(Shard(dim=0),)"),
    ("ep2x2_e4", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
    ("ep4_e4", "(_StridedShard(dim=0, sf=4), Shard(dim=0))"),
    ("ep2x2_e2", "(Shard(dim=1), Shard(dim=0))"),
    ("fsdp4_e2", "(Shard(dim=1),)"),
    ("hsdp4_e4", "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"),
    ("tp2_e4", "(Shard(dim=0), Shard(dim=1))|(Shard(dim=0), Shard(dim=2))"),  # TP cuts w1/w3 colwise, w2 rowwise
    ("eptp4_e4", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),  # EP takes the TP ranks: whole experts
    ("ppep4_e4", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
])
def test_the_experts_have_torchtitans_placements(moe, tag, placements):
    got = {n: pl for r in load(moe, tag) for n, pl in r["ref"]["placements"].items() if "inner_experts" in n}
    assert len(got) == 6 and set(got.values()) == set(placements.split("|")), got


def test_experts_are_muon_matrices_and_gefen_blocks(moe):
    st = state(load(moe, "one_e4"))
    recs = records(st)
    for layer in ("0", "1"):
        for w, kind in (("w1_EFD", "muon"), ("w3_EFD", "muon"), ("w2_EDF", "optimizer")):
            fqn = EXPERTS.format(layer, w)
            got_kind, rec = recs[fqn]
            assert got_kind == kind and len(rec["shape"]) == 3 and rec["period"] > 1, (fqn, got_kind, rec)
            assert rec["shape"][-1] % rec["period"] == 0
        rows = st[f"gefen/muon_rows/{EXPERTS.format(layer, 'w1_EFD')}"]
        assert rows.shape == (4, 96) and bool((rows > 0).all())  # NorMuon: one per row of every expert


@pytest.mark.parametrize("tag", [t for _, _, t, ref, _, _ in RUNS if ref and not t.startswith("one")])
def test_state_and_parameters_are_bit_identical_at_every_layout(moe, tag):
    one = f"one_e{experts(tag)}"
    ref, other = load(moe, one), load(moe, tag)
    assert differences(state(ref), state(other)) == []
    want, got = params(ref), params(other)
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


# ------------------------------------------------------------------ reshard
@pytest.mark.parametrize("src, tgt", PAIRS)
def test_reshard_is_bit_exact(moe, src, tgt):
    resume_tag = next(tag for _, _, tag, _, loads, _ in RUNS if src in loads and target(tag) == tgt)
    saved = state(load(moe, src.removeprefix("c_")))
    loaded_ranks = load(moe, resume_tag)
    assert differences(saved, state(loaded_ranks, src)) == []
    got, want = params(loaded_ranks, src), params(load(moe, tgt))
    assert got.keys() <= want.keys() and got
    assert [k for k in got if not torch.equal(got[k], want[k])] == []


# ------------------------------------------------------------------ schedule
def _owners(moe, tag: str) -> list[dict]:
    return [dict(pair for bucket in r["ref"]["state"]["schedule"] for pair in bucket) for r in load(moe, tag)]


def test_whole_experts_are_orthogonalized_where_they_lie(moe):
    """EP 2 at 2 ranks: rank 0 holds experts 0-1, rank 1 experts 2-3 of each grouped weight; each
    owns its own (no exchange), and every rank plans every matrix alike."""
    owners = _owners(moe, "ep2_e4")
    assert owners[0] == owners[1]
    for layer in ("0", "1"):
        for w in ("w1_EFD", "w3_EFD"):
            fqn = EXPERTS.format(layer, w)
            assert [owners[0][f"{fqn}[{e}]"] for e in range(4)] == [0, 0, 1, 1]


def test_cut_experts_go_to_one_of_their_holders_and_load_is_spread(moe):
    """EP 2 x efsdp 2 with 2 experts (Shard(1)): expert e's rows lie on the two ranks of EP
    coordinate e; its owner is one of them, and every rank owns some expert."""
    owners = _owners(moe, "ep2x2_e2")
    assert all(o == owners[0] for o in owners)
    chosen = {fqn: o for fqn, o in owners[0].items() if "inner_experts" in fqn}
    assert len(chosen) == 8
    for fqn, o in chosen.items():
        e = int(fqn.rsplit("[", 1)[1].rstrip("]"))
        assert o in (e, e + 2), (fqn, o)  # the mesh (efsdp, ep) = [[0, 1], [2, 3]]: ep coordinate e
    assert set(chosen.values()) == {0, 1, 2, 3}
