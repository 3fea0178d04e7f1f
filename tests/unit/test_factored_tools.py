"""A factored checkpoint (format v4, ``second_moment = "factored"``) through a single-process resume and the
offline tools: ``inspect`` and ``verify`` read it through Gefen's description, ``export`` writes it whole,
``convert`` maps it to AdamW's moments (the rebuilt second moment) and AdamW's back to factored state."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from gefen_titan.checkpoint.format import schema
from gefen_titan.checkpoint.io import storage
from gefen_titan.ckpt_tools import cli
from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.container import GefenOptimizersContainer
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen.options import GefenOptions
from tests.helpers.tiny_checkpoint import manager


def _build(seed: int, second_moment: str = "factored", name: str = "Gefen"):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 24, bias=False), nn.LayerNorm(24), nn.Linear(24, 16, bias=False))
    config = {"gefen": GefenOptions(second_moment=second_moment)} if name == "Gefen" else {}
    return net, GefenOptimizersContainer.Config(name=name, lr=1e-2, **config).build(model_parts=[net])


def _train(net, opt, steps: int) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        net(torch.randn(8, 16, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("factored_ckpt")
    net, opt = _build(0)
    _train(net, opt, 2)
    manager(root, net, opt, step=2).save(curr_step=2)
    return root, root / "ckpt" / "step-2", net, opt


def _load(path, keys):
    md = storage.read_metadata(path).state_dict_metadata
    out = {k: torch.empty(md[k].size, dtype=md[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=storage.storage_reader(path), no_dist=True)
    return out


def _run(capsys, *args):
    rc = cli.main([str(a) for a in args] + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_a_factored_checkpoint_resumes_as_saved(saved):
    root, _, net, opt = saved
    net2, opt2 = _build(5)
    assert manager(root, net2, opt2, step=2).load(step=2)
    (a,), (b,) = opt.optimizers_of("Gefen"), opt2.optimizers_of("Gefen")
    for (n, p, _), (_, q, _) in zip(gx.named_params(a), gx.named_params(b)):
        sa, sb = gx.gefen_read(a, p), gx.gefen_read(b, q)
        assert sa.factored == sb.factored == (p.dim() == 2), n
        for what in ("codes", "magnitude", "vmean", "v_row", "v_col"):
            x, y = getattr(sa, what), getattr(sb, what)
            assert (x is None and y is None) or torch.equal(x, y), (n, what)


def test_inspect_and_verify_read_it(saved, capsys):
    _, path, _, _ = saved
    rc, report = _run(capsys, "inspect", path)
    assert rc == 0 and report["format"]["version"] == schema.VERSION == 4
    rows = {p["fqn"]: p for p in report["optimizers"][0]["params"]}
    assert rows["0.weight"]["second_moment"] == "factored" and "second_moment" not in rows["1.weight"]
    assert rows["0.weight"]["bytes"] == 24 * 16 + 4 * 24 * (16 // rows["0.weight"]["period"]) + 4 * (24 + 16)
    rc, report = _run(capsys, "verify", path)
    assert rc == 0 and report["ok"] and report["problems"] == [], report["problems"]


def test_export_keeps_the_rows_and_columns(saved, capsys, tmp_path):
    _, path, _, _ = saved
    rc, _ = _run(capsys, "export", path, tmp_path / "all.pt")
    assert rc == 0
    sd = torch.load(tmp_path / "all.pt", weights_only=True)
    flat = json.dumps(list(sd["optimizer"]))
    assert gefen_keys.vrow_key("0.weight") in flat and gefen_keys.vcol_key("2.weight") in flat


def test_convert_to_adamw_rebuilds_the_second_moment_and_back(saved, capsys, tmp_path):
    _, path, _, _ = saved
    fqn = "0.weight"
    rc, report = _run(capsys, "convert", path, tmp_path / "adamw", "--to", "adamw")
    assert rc == 0, report
    g = _load(path, ["optimizer." + gefen_keys.vrow_key(fqn), "optimizer." + gefen_keys.vcol_key(fqn)])
    v_row, v_col = g["optimizer." + gefen_keys.vrow_key(fqn)], g["optimizer." + gefen_keys.vcol_key(fqn)]
    a = _load(tmp_path / "adamw", [f"optimizer.state.{fqn}.exp_avg_sq"])[f"optimizer.state.{fqn}.exp_avg_sq"]
    assert torch.allclose(a, torch.outer(v_row, v_col) / v_row.double().mean().float(), rtol=1e-6, atol=0)

    rc, report = _run(capsys, "convert", tmp_path / "adamw", tmp_path / "back", "--to", "gefen",
                      "--second-moment", "factored")
    assert rc == 0 and report["second_moment"] == "factored", report
    assert report["second_moment_relative_rms_error"] < 1e-5  # a rank-one exp_avg_sq factors back exactly
    b = _load(tmp_path / "back", ["optimizer." + gefen_keys.vrow_key(fqn), "optimizer." + gefen_keys.vcol_key(fqn)])
    assert torch.allclose(b["optimizer." + gefen_keys.vrow_key(fqn)], a.double().mean(dim=1).float())
    rc, report = _run(capsys, "verify", tmp_path / "back")
    assert rc == 0 and report["ok"], report["problems"]


def test_the_validations_dense_state_rebuilds_the_factored_moment(saved):
    """The reshard validation compares the dense state a checkpoint implies: a factored parameter's second
    moment is its rows and columns rebuilt, the momentum its codes and magnitudes."""
    from gefen_titan.checkpoint.io.storage import load_all
    from gefen_titan.optim.kinds.gefen.factored import rebuilt
    from gefen_titan.optim.kinds.gefen.validation import dense

    _, path, _, opt = saved
    entries = load_all(path)["optimizer"]
    got = dense(entries)
    (optim,) = opt.optimizers_of("Gefen")
    for fqn, p, _ in gx.named_params(optim):
        st = gx.gefen_read(optim, p)
        want_v = (rebuilt(st.v_row, st.v_col, tuple(p.shape)) if st.factored
                  else st.vmean.repeat_interleave(st.period, dim=-1))
        assert torch.equal(got[fqn]["v"], want_v.reshape(-1)), fqn
        m = gx.codebook(optim)[st.codes.long()] * st.magnitude
        assert torch.equal(got[fqn]["m"], m.reshape(-1)), fqn
