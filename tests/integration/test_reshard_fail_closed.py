"""Bad Gefen checkpoints fail closed: every rank raises the same clear error
(no rank hangs) and the live optimizer is exactly as it was.

One 2-rank launch tries every bad checkpoint in turn on a stepped optimizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from tests.helpers.reshard_analysis import load_run
from tests.helpers.reshard_runs import SAVE_STEP, launch

STEP_DIR = f"step-{SAVE_STEP}"


def _edited(src: Path, dst: Path, edit) -> None:
    """Copy of checkpoint ``src`` with its state dict passed through ``edit``."""
    full = dst.parent / (dst.name + ".pt")
    dcp_to_torch_save(str(src / "ckpt" / STEP_DIR), str(full))
    sd = torch.load(full, weights_only=False)
    edit(sd["optimizer"])
    torch.save(sd, full)
    torch_save_to_dcp(str(full), str(dst / "ckpt" / STEP_DIR))


def _set_hyper(fqn, name, value):
    def edit(opt):
        for key in [k for k in opt if k.startswith("gefen/optimizer/")]:
            meta = json.loads(opt[key])
            for rec in meta["params"]:
                if rec["fqn"] == fqn:
                    rec["group"][name] = value
            opt[key] = json.dumps(meta)

    return edit


def _record(opt, fqn):
    """(records key of source rank 0's table, row of ``fqn``)."""
    for key in [k for k in opt if k.startswith("gefen/optimizer/")]:
        names = [rec["fqn"] for rec in json.loads(opt[key])["params"]]
        if fqn in names:
            return key.replace("gefen/optimizer/", "gefen/records/"), 1 + names.index(fqn)
    raise KeyError(fqn)


def _set_record(fqn, rank, column, fn):
    def edit(opt):
        key, row = _record(opt, fqn)
        key = f"{key}/{rank}"
        opt[key][row, column] = fn(int(opt[key][row, column]))

    return edit


def _nan_blocks(fqn, rank):
    def edit(opt):
        key, row = _record(opt, fqn)
        table = opt[f"{key}/{rank}"]
        b0, nb = int(table[row, 5]), int(table[row, 6])
        opt[f"{key}/{rank}".replace("/records/", "/blocks/")][b0 : b0 + nb] = float("nan")

    return edit


def _set(key, fn):
    def edit(opt):
        opt[key] = fn(opt[key])

    return edit


def _drop(key):
    return lambda opt: opt.pop(key)


CASES = {
    "format": (_set("gefen/format", lambda v: json.dumps({"format": "gefen-titan", "version": 99})), "v1"),
    "other_model": (_drop("gefen/codes/output.weight"), "no Gefen state for 1 live parameter"),
    "shape": (_set("gefen/codes/output.weight", lambda v: v[:256].clone()), "the checkpoint is for another model"),
    "nonfinite": (_nan_blocks("layers.0.w1.weight", 1), "non-finite"),
    "counters": (_set_record("layers.1.w2.weight", 0, 4, lambda v: 99), "counters do not add up"),
    "hyper": (_set_hyper("norm.weight", "beta1", 1.5), "cannot be represented"),
    "codebook": (_set("gefen/codebook/tok_embeddings.weight/0", lambda v: v.flip(0)), "codebook of source rank 0"),
    "gap": (_set_record("layers.0.w2.weight", 1, 0, lambda v: v + 128), "do not tile"),
}


@pytest.fixture(scope="module")
def results(runs, tmp_path_factory):
    base, _ = runs
    src = base / "c2"
    root = tmp_path_factory.mktemp("bad")
    cases = []
    for name, (edit, _) in CASES.items():
        _edited(src, root / name, edit)
        cases.append(root / name)
    # A file missing and a file cut short.
    for name, damage in (("missing", lambda f: f.unlink()), ("truncated", lambda f: f.write_bytes(f.read_bytes()[:1000]))):
        shutil.copytree(src, root / name)
        damage(root / name / "ckpt" / STEP_DIR / "__1_0.distcp")
        cases.append(root / name)
    # A checkpoint of another optimizer (AdamW) for the same model.
    launch(2, "--mode", "ref", "--optimizer", "AdamW", "--ckpt", str(root / "adamw"), "--out", str(root),
           "--save-step", str(SAVE_STEP), "--steps", "0")
    cases.append(root / "adamw")
    out = root / "out"
    out.mkdir()
    launch(2, "--mode", "corrupt", "--ckpt", str(src), "--out", str(out), "--save-step", str(SAVE_STEP),
           "--cases", ",".join(map(str, cases)))
    return load_run(str(out), "corrupt", 2)


EXPECTED = {**{k: v[1] for k, v in CASES.items()}, "missing": "cannot read", "truncated": "cannot read",
            "adamw": "another optimizer's state"}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_checkpoint_fails_closed_on_every_rank(results, case):
    for rank in results:
        got = rank["cases"][case]
        assert got["error"] is not None, f"{case}: load succeeded on rank {rank['rank']}"
        assert "GefenCheckpointError" in got["error"], got["error"]
        assert EXPECTED[case] in got["error"], got["error"]
        before, after = got["before"], got["after"]
        assert before.keys() == after.keys()
        for name, rec in before.items():
            for key, value in rec.items():
                other = after[name][key]
                same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                assert same, f"{case}: live {name}.{key} changed by a failed load"
    # Every rank got the same message.
    assert len({rank["cases"][case]["error"] for rank in results}) == 1


def test_foreign_optimizer_error_says_what_to_do(results):
    assert "exclude_from_loading" in results[0]["cases"]["adamw"]["error"]
