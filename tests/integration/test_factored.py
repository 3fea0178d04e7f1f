"""The factored second moment (``[optimizer.gefen] second_moment = "factored"``) under real layouts on gloo.

The agreed-blocking worker (``agreed_worker.py``: a small Llama-like model, every layout fed bit-identical
global gradients) run factored (``tests.helpers.factored_runs``):

* layout invariance: after 3 steps the state (codes, magnitudes, row and column EMAs, periods, codebook,
  records) and the parameters are bit-identical at W=1, 2, 3 (uneven rows, an empty shard), FSDP 2 x TP 2,
  TP 2, HSDP 2 x 2, 2 pipeline stages and FSDP 2 with CPU offload;
* the reshard matrix (format v4): the loaded global state is the saved one bit for bit, and the
  parameters 2 steps later equal the uninterrupted run's at the target layout;
* a resume that switches the second moment (block -> factored, factored -> block) keeps the momentum and
  steps and restarts the second moment from zero;
* mixture of experts (``moe_worker``: Gefen alone, each expert of a grouped ``(E, out, in)`` weight its
  own matrix): the same bits at EP 2, EP 1 x FSDP 2, EP 2 x efsdp 2 (the experts' rows cut) and one rank,
  and EP 2 -> EP 1 / one rank, EP 2 x efsdp 2 -> one rank resume bit-exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from tests.helpers import factored_runs, worker_jobs
from tests.helpers.factored_runs import MOE_PAIRS, PAIRS, RUNS, SWITCHES, target
from tests.integration.test_agreed_blocking import _equal_state, _records, merged

load = worker_jobs.rank_dumps
MATRICES = ("tok_embeddings.weight", "layers.0.w1.weight", "layers.1.w2.weight", "output.weight", "gate.weight")


@pytest.fixture(scope="module")
def factored(tmp_path_factory) -> Path:
    """Every job of ``factored_runs.PLAN``: their outputs."""
    _, out, _ = worker_jobs.launched(tmp_path_factory.mktemp("factored"), factored_runs.plan)
    return out


def _ref(out: Path, tag: str) -> dict:
    return merged(load(out, tag), "ref")


def test_the_second_moment_is_factored_and_no_larger(factored):
    state = _ref(factored, "f_fsdp1")["state"]
    records = _records(state)
    for fqn, rec in records.items():
        shape = tuple(rec["shape"])
        if len(shape) < 2:
            assert "second_moment" not in rec and state[gefen_keys.grid_key(fqn)].shape[-1] == 2, fqn
            continue
        assert rec["second_moment"] == "factored" and rec["vmean_step"] == rec["step"] == factored_runs.S, fqn
        assert state[gefen_keys.grid_key(fqn)].shape[-1] == 1, fqn  # the magnitude alone
        rows, cols = state[gefen_keys.vrow_key(fqn)], state[gefen_keys.vcol_key(fqn)]
        assert rows.shape == shape[:-1] and cols.shape == shape[:-2] + shape[-1:], fqn
        assert bool((rows > 0).all()) and bool((cols > 0).all()), fqn
    assert set(MATRICES) <= {f for f, r in records.items() if r.get("second_moment")}
    # Per parameter, the rows and columns replace a vmean per block: the state is no larger than block's.
    factored_bytes, numel = load(factored, "f_fsdp2")[0]["ref"]["bytes"]
    block_bytes, block_numel = load(factored, "b_fsdp2")[0]["ref"]["bytes"]
    assert numel == block_numel and factored_bytes <= block_bytes, (factored_bytes, block_bytes)
    # ... and it trains differently from block's.
    f_params, b_params = _ref(factored, "f_fsdp2")["params"], _ref(factored, "b_fsdp2")["params"]
    last = max(f_params)
    assert not torch.equal(f_params[last]["layers.0.w1.weight"], b_params[last]["layers.0.w1.weight"])


@pytest.mark.parametrize("tag", ["f_fsdp2", "f_fsdp2_offload", "f_fsdp3", "f_fsdp_tp4", "f_tp2", "f_hsdp4",
                                 "f_pp2"])
def test_state_is_bit_identical_at_every_layout(factored, tag):
    one, other = _ref(factored, "f_fsdp1"), _ref(factored, tag)
    assert _equal_state(one["state"], other["state"]) == []
    assert _records(one["state"]) == _records(other["state"])
    for s, ps in one["params"].items():
        for name, p in ps.items():
            assert torch.equal(p, other["params"][s][name]), (tag, s, name)


@pytest.mark.parametrize("src, tgt", PAIRS)
def test_reshard_matrix_is_bit_exact(factored, src, tgt):
    resume_tag = next(tag for _, _, tag, _, loads in RUNS if src in loads and target(tag) == tgt)
    saved = _ref(factored, src.removeprefix("c_"))
    loaded = merged(load(factored, resume_tag), "resume", src)
    uninterrupted = _ref(factored, tgt)
    assert _equal_state(saved["state"], loaded["state"]) == []
    assert _records(saved["state"]) == _records(loaded["state"])
    for s, ps in loaded["params"].items():
        for name, p in ps.items():
            assert torch.equal(p, uninterrupted["params"][s][name]), (src, tgt, s, name)


@pytest.mark.parametrize("tag", sorted(SWITCHES))
def test_a_resume_that_switches_restarts_the_second_moment(factored, tag):
    src = SWITCHES[tag]
    saved = _ref(factored, src.removeprefix("c_"))["state"]
    loaded = merged(load(factored, tag), "resume", src)
    state = loaded["state"]
    to_factored = tag.startswith("f_")
    for fqn, rec in _records(state).items():
        before = _records(saved)[fqn]
        assert rec["step"] == before["step"] and rec["period"] == before["period"], fqn
        assert torch.equal(state[gefen_keys.qcodes_key(fqn)], saved[gefen_keys.qcodes_key(fqn)]), fqn
        grid, saved_grid = state[gefen_keys.grid_key(fqn)], saved[gefen_keys.grid_key(fqn)]
        assert torch.equal(grid[..., 0], saved_grid[..., 0]), fqn  # the magnitudes load as saved
        if len(rec["shape"]) < 2:  # not factored either way: as saved
            assert rec == before and torch.equal(grid, saved_grid), fqn
            continue
        assert rec["vmean_step"] == 0, fqn  # the second moment restarts
        if to_factored:
            assert rec["second_moment"] == "factored" and grid.shape[-1] == 1
            assert not state[gefen_keys.vrow_key(fqn)].any() and not state[gefen_keys.vcol_key(fqn)].any()
        else:
            assert "second_moment" not in rec and grid.shape[-1] == 2 and not grid[..., 1].any()
            assert gefen_keys.vrow_key(fqn) not in state
    for ps in loaded["params"].values():
        assert all(bool(torch.isfinite(p).all()) for p in ps.values())


def test_records_are_json_a_v3_reader_would_take_for_block_parameters(factored):
    """A block parameter's record in v4 is v3's, key for key (only the header's version changed)."""
    state = _ref(factored, "b_fsdp2")["state"]
    for key, value in state.items():
        if key.startswith("gefen/optimizer/"):
            for rec in json.loads(value)["params"]:
                assert set(rec) == {"fqn", "shape", "period", "step", "vmean_step", "group"}


# ------------------------------------------------------------------ mixture of experts
@pytest.fixture(scope="module")
def moe_runs(moe_launch) -> Path:
    """Every MoE job of ``factored_runs``, run in the MoE launches (conftest's ``moe_launch``)."""
    return moe_launch


def _moe(ranks: list[dict], src: str | None = None) -> tuple[dict, dict]:
    """(state, parameters) of a MoE run over its ranks: the ranks that dump an entry agree on it."""
    state, params = {}, {}
    for r in ranks:
        part = r["ref"] if src is None else r["resume"][src]
        for k, v in part["state"].items():
            if k == "schedule":
                continue
            if k in state:
                assert (torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v), k
            state[k] = v
        for s, ps in part["params"].items():
            params.update({(s, n): p for n, p in ps.items()})
    return state, params


def _same_state(a: dict, b: dict) -> list[str]:
    return [k for k in sorted(set(a) | set(b)) if not (
        isinstance(a.get(k), torch.Tensor) and isinstance(b.get(k), torch.Tensor) and torch.equal(a[k], b[k])
        or a.get(k) == b.get(k))]


def test_grouped_experts_are_factored_per_expert(moe_runs):
    state, _ = _moe(load(moe_runs, "fm_one_e4"))
    experts = [r for r in _records(state).values() if len(r["shape"]) == 3]
    assert experts and all(r["second_moment"] == "factored" for r in experts)
    for rec in experts:
        e, out_, in_ = rec["shape"]
        assert state[gefen_keys.vrow_key(rec["fqn"])].shape == (e, out_)
        assert state[gefen_keys.vcol_key(rec["fqn"])].shape == (e, in_)


@pytest.mark.parametrize("tag", ["fm_ep2_e4", "fm_fsdp2_e4", "fm_ep2x2_e2"])
def test_moe_state_is_bit_identical_at_every_layout(moe_runs, tag):
    one = "fm_one_e" + tag.rsplit("_e", 1)[1]
    (a, pa), (b, pb) = _moe(load(moe_runs, one)), _moe(load(moe_runs, tag))
    assert _same_state(a, b) == []
    assert pa.keys() == pb.keys() and [k for k in pa if not torch.equal(pa[k], pb[k])] == []


@pytest.mark.parametrize("src, tgt", MOE_PAIRS)
def test_moe_reshard_is_bit_exact(moe_runs, src, tgt):
    saved, _ = _moe(load(moe_runs, src.removeprefix("c_")))
    loaded, got = _moe(load(moe_runs, tgt), src)
    _, want = _moe(load(moe_runs, tgt))
    assert _same_state(saved, loaded) == []
    assert got and [k for k in got if not torch.equal(got[k], want[k])] == []
