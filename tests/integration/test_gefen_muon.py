"""GefenMuon under gefen-titan: sharded like the parameter, identical at every layout, resharded bit-exactly.

A small model under real FSDP2 / FSDP x TP / HSDP / pipeline layouts on
gloo (``muon_worker.py``): GefenMuon (NorMuon on) steps the hidden matrices
and the 2-row ``gate`` (an empty shard at W=3 and W=4), Gefen the rest, every
layout fed bit-identical global gradients:

* gefen-x: at W=1 the parameters and GefenMuon's state equal gefen-x's own
  single-process ``GefenMuon`` given the same periods and codebook, after
  every step;
* layout invariance: parameters, GefenMuon's and Gefen's state bit-identical
  at W=1, 2, 3, 4, FSDP 2 x TP 2, HSDP 2 x 2, 2 pipeline stages (x FSDP 2);
  each rank keeps only its share of the state;
* the reshard matrix through GefenCheckpointManager: the loaded global state
  is bit-identical to the saved one, and the parameters after 2 more steps
  equal the uninterrupted run at the target layout;
* fail closed: bad GefenMuon entries and records, and a checkpoint of one
  optimizer kind loaded by the other, refused on every rank with live state
  unchanged;
* the schedule: every member of a stage ran the same buckets, an owner
  agrees it owns what its members send it, several owners computed in a
  bucket, and each rank's peak bytes in flight stayed within the bound.

The jobs are ``tests.helpers.muon_runs``'s plan: five launches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gefen_titan.optim import gefenx as gx
from tests.helpers import muon_runs, worker_jobs
from tests.helpers.bad_checkpoints import MUON_CASES, muon_case_key
from tests.helpers.muon_runs import PAIRS, RUNS, target

_PER_STAGE = ("gefen/optimizer/", "gefen/codebook/", "gefen/muon/", "gefen/muon_codebook/")


load = worker_jobs.rank_dumps


@pytest.fixture(scope="module")
def muon(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Every job of ``muon_runs.PLAN``: (base folder, outputs, bad checkpoints)."""
    return worker_jobs.launched(tmp_path_factory.mktemp("muon"), muon_runs.plan)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def merged(ranks: list[dict], kind: str, src: str | None = None) -> dict:
    """The global picture over every stage; the ranks of a stage must agree."""
    state: dict = {}
    live: dict = {"periods": {}, "counters": {}, "tensors": {}, "codebooks": []}
    params: dict = {}
    for r in ranks:
        res = r["ref"] if kind == "ref" else r["resume"][src]
        for key, value in res["state"].items():
            if key == "muon":
                if value:
                    for part in ("periods", "counters", "tensors"):
                        live[part].update(value[part])
                    live["codebooks"].append(value["codebook"])
                continue
            if key in state and not key.startswith(_PER_STAGE):
                assert _same(state[key], value), f"ranks disagree on {key}"
            state[key] = value
        for s, ps in res["params"].items():
            params.setdefault(s, {}).update(ps)
    return {"state": state, "live": live, "params": params}


def _ref(out: Path, tag: str) -> dict:
    return merged(load(out, tag), "ref")


def records(state: dict) -> dict:
    """Per parameter: (kind, its record) from every optimizer record of every stage."""
    out = {}
    for key, value in state.items():
        for prefix in ("gefen/optimizer/", "gefen/muon/"):
            if key.startswith(prefix):
                for rec in json.loads(value)["params"]:
                    out[rec["fqn"]] = (prefix, rec)
    return out


def codebook(state: dict, prefix: str) -> torch.Tensor:
    """The job's one codebook of a family: every stage's copy must be it."""
    books = [v for k, v in state.items() if k.startswith(prefix)]
    assert books, f"no {prefix} entry"
    assert all(torch.equal(books[0], b) for b in books[1:]), f"{prefix}: stages hold different codebooks"
    return books[0]


def differences(a: dict, b: dict) -> list[str]:
    bad = [p for p in ("gefen/codebook/", "gefen/muon_codebook/")
           if not torch.equal(codebook(a, p), codebook(b, p))]
    if records(a) != records(b):
        bad.append("records")
    for key in sorted(set(a) | set(b)):
        if not key.startswith(_PER_STAGE) and not _same(a.get(key), b.get(key)):
            bad.append(key)
    return bad


def _equal_params(got: dict, want: dict, what) -> None:
    assert got.keys() <= want.keys()
    for s, ps in got.items():
        for name, p in ps.items():
            assert torch.equal(p, want[s][name]), (what, s, name)


# ------------------------------------------------------------------ layouts
def test_matches_gefen_x_single_process(muon):
    _, out, _ = muon
    (rank0,) = load(out, "fsdp1")
    assert rank0["ref"]["gefen_x"] == [], rank0["ref"]["gefen_x"][:10]
    ref = _ref(out, "fsdp1")
    kinds = {fqn: kind for fqn, (kind, _) in records(ref["state"]).items()}
    muon_params = sorted(f for f, k in kinds.items() if k == "gefen/muon/")
    assert muon_params == ["gate.weight", "layers.0.w1.weight", "layers.0.w2.weight", "layers.1.w1.weight",
                           "layers.1.w2.weight"]
    # real quantized state: blocks inside rows, NorMuon rows after S steps
    for fqn in muon_params:
        period = ref["live"]["periods"][fqn]
        assert 1 < period and ref["params"][muon_runs.S][fqn].shape[-1] % period == 0, (fqn, period)
        assert ref["live"]["counters"][fqn][:2] == (muon_runs.S, muon_runs.S)
        assert ref["state"][f"gefen/muon_rows/{fqn}"].shape == (ref["params"][muon_runs.S][fqn].shape[0],)
    assert ref["state"]["gefen/muon_codes/gate.weight"].shape == (2, 64)


@pytest.mark.parametrize("tag", ["fsdp2", "fsdp2_offload", "fsdp3", "fsdp4", "fsdp_tp4", "hsdp4", "pp2", "pp4"])
def test_state_is_bit_identical_at_every_layout(muon, tag):
    _, out, _ = muon
    one, other = _ref(out, "fsdp1"), _ref(out, tag)
    assert differences(one["state"], other["state"]) == []
    for part in ("periods", "counters"):
        assert one["live"][part] == other["live"][part], part
    _equal_params(other["params"], one["params"], tag)


def test_live_state_is_what_the_checkpoint_holds(muon):
    _, out, _ = muon
    for tag in ("fsdp1", "fsdp_tp4", "pp4"):
        ref = _ref(out, tag)
        assert all(torch.equal(b, codebook(ref["state"], "gefen/muon_codebook/")) for b in ref["live"]["codebooks"])
        for fqn, tensors in ref["live"]["tensors"].items():
            for what, t in tensors.items():
                assert torch.equal(t, ref["state"][f"gefen/muon_{what}/{fqn}"]), (tag, fqn, what)


def test_each_rank_keeps_its_share_of_the_state(muon):
    _, out, _ = muon
    whole, numel = load(out, "fsdp1")[0]["ref"]["bytes"]
    assert 1.0 < whole / numel < 1.6, whole / numel
    shares = [r["ref"]["bytes"] for r in load(out, "fsdp4")]
    assert sum(n for _, n in shares) == numel
    # Each rank: a quarter of the state plus the codebooks every rank keeps
    # (a Gefen and a GefenMuon one, 256 fp32 each). Measured 29,056 bytes on
    # ranks 0-1 against 28,991 by that count (+0.2%: the 2-row gate and the
    # norms cut unevenly); 1% allows that, not a replicated matrix.
    # Gefen's matrices (the embedding and the output) have the factored second moment, the default:
    # every rank keeps their whole columns (FSDP cuts rows), so those count whole on each rank too.
    books = 2 * gx.K * 4
    state = _ref(out, "fsdp1")["state"]
    columns = sum(4 * t.numel() for k, t in state.items() if k.startswith("gefen/vcol/"))
    assert columns > 0
    for state_bytes, _ in shares:
        assert state_bytes <= ((whole - books - columns) / 4 + books + columns) * 1.01, (state_bytes, whole)


# ------------------------------------------------------------------ reshard
@pytest.mark.parametrize("src, tgt", PAIRS)
def test_reshard_matrix_is_bit_exact(muon, src, tgt):
    _, out, _ = muon
    resume_tag = next(tag for _, _, tag, _, loads in RUNS if src in loads and target(tag) == tgt)
    saved = _ref(out, src.removeprefix("c_"))
    loaded = merged(load(out, resume_tag), "resume", src)
    assert differences(saved["state"], loaded["state"]) == []
    for part in ("periods", "counters"):
        assert saved["live"][part] == loaded["live"][part], part
    _equal_params(loaded["params"], _ref(out, tgt)["params"], (src, tgt))


# -------------------------------------------------------------- fail closed
@pytest.mark.parametrize("name", sorted(MUON_CASES))
def test_bad_checkpoint_fails_closed_on_every_rank(muon, name):
    _, out, _ = muon
    got = [r["cases"][muon_case_key(name)] for r in load(out, "bad")]
    expected = MUON_CASES[name][3]
    for g in got:
        assert g["error"] is not None, "the load succeeded"
        assert "GefenCheckpointError" in g["error"], g["error"]
        assert expected in g["error"], g["error"]
        assert g["before"].keys() == g["after"].keys()
        for key, before in g["before"].items():
            after = g["after"][key]
            if isinstance(before, tuple):
                assert all(_same(a, b) for a, b in zip(before, after, strict=True)), f"live {key} changed"
            else:
                assert _same(before, after), f"live {key} changed"
    assert len({g["error"] for g in got}) == 1, "ranks raised different errors"


# ----------------------------------------------------------------- schedule
@pytest.mark.parametrize("tag", ["fsdp2", "fsdp3", "fsdp4", "fsdp_tp4", "hsdp4", "pp4"])
def test_every_member_runs_the_same_schedule_with_owners_at_once(muon, tag):
    _, out, _ = muon
    ranks = [r["ref"]["schedule"] for r in load(out, tag)]
    stages: dict[frozenset, list[int]] = {}
    for r, s in enumerate(ranks):
        stages.setdefault(frozenset(f for b in s["buckets"] for f, _ in b), []).append(r)
    for members in stages.values():
        shapes = {json.dumps([[f for f, _ in b] for b in ranks[r]["buckets"]]) for r in members}
        assert len(shapes) == 1, f"{tag}: ranks {members} built different buckets"
        buckets = ranks[members[0]]["buckets"]
        if tag in ("fsdp2", "fsdp3", "hsdp4"):
            # groups of 2-3: a rank's share of the four 192 x 64 matrices is over
            # muon_worker's ~98 KiB limit, so two live buckets ran (at 4 ranks, or a
            # pipeline stage's two matrices, one bucket holds them)
            assert len(buckets) > 1, buckets
        for r in members:
            for i, b in enumerate(ranks[r]["buckets"]):
                for fqn, owner in b:  # the owner a member sends to agrees that it owns the matrix
                    if owner >= 0:
                        assert dict(ranks[owner]["buckets"][i])[fqn] == owner, (tag, r, fqn)
        owners_at_once = [len({o for r in members for _, o in ranks[r]["buckets"][i]}) for i in range(len(buckets))]
        assert max(owners_at_once) > 1, owners_at_once
    for r, s in enumerate(ranks):
        (stats,) = s["stats"] or [None]
        if stats is None:
            continue
        assert 0 < stats["peak"] <= stats["bound"], (r, stats)
        assert stats["sent"] > 0 and stats["received"] > 0, (r, stats)
    if tag.startswith("fsdp") and "_" not in tag:  # one group: each matrix orthogonalized once a step
        n = sum(len(b) for b in ranks[0]["buckets"])
        assert sum(s["stats"][0]["ns_matrices"] for s in ranks) == n * ranks[0]["stats"][0]["steps"]
