"""The committed format-v2 checkpoint loads bit-exactly at other sizes.

``tests/fixtures/v2_debug_fsdp2_step3`` was written by the trainer (the debug
recipe, 2 gloo ranks, FSDP2, 3 steps, agreed blocking; without the model's
weights, see ``tests/helpers/fixture_hooks.py`` and ``tests/fixtures/README.md``). Loaded
by the trainer (``train.py``'s main) at 1 and at 3 ranks (3: uneven row shards), the optimizer
state that the container then holds, gathered to global tensors (as a v3
save would write it), must be the fixture's entries bit for bit: every code,
block magnitude and ``vmean`` (v3 packs the two in one grid entry), the
codebook, and the JSON records (periods, counters, hyperparameters); the
header is v3's. The fixture was written under the block second moment, so the
3-rank load resumes it as it ran (``second_moment = "block"``); the 1-rank load
takes the default (factored), which keeps every code, magnitude and period
and restarts the matrices' second moment (docs/recipes.md, "Switching on a
resume"): what a v2 run resumed after the default changed does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchtitan.components.checkpoint import OPTIMIZER

import gefen_titan.train
from gefen_titan.checkpoint.format import schema, schema_records
from gefen_titan.ckpt_tools.view import Checkpoint
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from tests.helpers import processes

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "v2_debug_fsdp2_step3"
STEP = 3


@pytest.fixture(scope="module")
def saved() -> dict:
    ck = Checkpoint(str(FIXTURE))
    names = sorted(ck.optimizer)
    values = ck.load_names(OPTIMIZER, names)
    header = json.loads(values["gefen/format"])
    assert header == {"format": "gefen-titan", "version": 2, "blocking": "agreed"}, header
    assert ck.writer_ranks() == [0, 1]
    return values


def _load(nproc: int, out: Path, *flags: str) -> dict:
    hook = json.dumps({"dir": str(out / "dumps")})
    # train.py's main on nproc ranks started as torchrun would (processes.run_ranks).
    processes.run_ranks(nproc, gefen_titan.train.main, [
        "--job.config", "recipes/llama_gefen.toml", "--training.steps", str(STEP),
        "--checkpoint.initial_load_path", str(FIXTURE), "--checkpoint.no-initial-load-model-only",
        "--dump_folder", str(out), "--override.imports", "gefen_titan.patches.sdpa_attention.sdpa_attention",
        f"tests.helpers.fixture_hooks.without_model={hook}", *flags], logs=out / "logs", timeout=600)
    dump = torch.load(out / "dumps" / f"load-{STEP}-global-rank0.pt", weights_only=False)
    assert dump["world"] == nproc and dump["blocking"] == "agreed"
    return dump


def _as_v3(v2: dict) -> dict:
    """The fixture's v2 entries as a v3 save writes the same state (schema's own layout functions)."""
    out = {schema.header_key(): schema_records.Header.for_blocking("agreed").to_json()}
    for name, value in v2.items():
        key = schema.parse_key(name)
        if key.kind == "magnitude":
            tensors = {n: v2[k] for n, k in gefen_keys.param_tensor_keys(key.name, schema.V2).items()}
            out[gefen_keys.grid_key(key.name)] = gefen_keys.pack_blocks(*gefen_keys.unpack_blocks(schema.V2, tensors))
        elif key.kind == "codes":
            out[gefen_keys.qcodes_key(key.name)] = value
        elif key.kind not in ("vmean", "header"):
            out[name] = value
    return out


def test_v2_fixture_loads_bit_exactly(saved, tmp_path):
    dump = _load(3, tmp_path, "--optimizer.gefen.second_moment", "block")
    loaded = dump["state"]
    # The next save writes the current format: v4, whose block state is v3's entries (``_as_v3``).
    assert json.loads(loaded[schema.header_key()])["version"] == schema.VERSION == 4
    expected = _as_v3(saved)
    assert sorted(loaded) == sorted(expected)
    stateful = 0
    for name, value in expected.items():
        got = loaded[name]
        if isinstance(value, str):
            assert got == value, name
            continue
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert torch.equal(got, value), f"{name} differs after loading at 3 ranks"
        stateful += name.startswith("gefen/qcodes/")
    assert stateful == 45  # every parameter of the debug model has Gefen state after 3 steps
    # The live optimizer on every rank holds the fixture's codebook.
    codebook = saved["gefen/codebook/tok_embeddings.weight"]
    for live in dump["live"]:
        for opt in live["Gefen"]["optimizers"].values():
            assert torch.equal(opt["codebook"], codebook)
            assert opt["global_step"] == STEP


def test_v2_fixture_resumes_into_the_factored_default(saved, tmp_path):
    loaded = _load(1, tmp_path)["state"]
    expected = _as_v3(saved)
    (rec_key,) = [k for k in expected if k.startswith("gefen/optimizer/")]
    before = {r["fqn"]: r for r in json.loads(expected[rec_key])["params"]}
    after = {r["fqn"]: r for r in json.loads(loaded[rec_key])["params"]}
    assert sorted(before) == sorted(after) and len(after) == 45
    factored = 0
    for fqn, rec in after.items():
        old = before[fqn]
        assert (rec["step"], rec["period"], rec["group"]) == (old["step"], old["period"], old["group"]), fqn
        assert torch.equal(loaded[gefen_keys.qcodes_key(fqn)], expected[gefen_keys.qcodes_key(fqn)]), fqn
        grid, saved_grid = loaded[gefen_keys.grid_key(fqn)], expected[gefen_keys.grid_key(fqn)]
        assert torch.equal(grid[..., 0], saved_grid[..., 0]), fqn  # the magnitudes, as saved
        if len(rec["shape"]) < 2:  # a vector keeps its block second moment, as saved
            assert rec == old and torch.equal(grid, saved_grid), fqn
            continue
        factored += 1
        assert rec["second_moment"] == "factored" and rec["vmean_step"] == 0, fqn  # restarted
        assert grid.shape[-1] == 1 and gefen_keys.vrow_key(fqn) in loaded and gefen_keys.vcol_key(fqn) in loaded
    assert factored > 0
