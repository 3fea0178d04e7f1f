"""The records stage's checks across kinds (``checkpoint.checks.record_checks``) and the kinds' descriptions
(``checkpoint.format.kinds``), on records built in memory and on the stored v2 checkpoint's (tests/fixtures):
no checkpoint is written (milliseconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from gefen_titan.checkpoint.checks import record_checks
from gefen_titan.checkpoint.format import kinds, schema, schema_records
from gefen_titan.checkpoint.io import storage
from gefen_titan.optim import registry
from gefen_titan.optim.kinds.gefen import keys as gefen_keys
from gefen_titan.optim.kinds.gefen import records as gefen_records
from gefen_titan.optim.kinds.gefen_muon import keys as muon_keys
from gefen_titan.optim.kinds.gefen_muon.records import MuonOptimizerRecord, MuonParamRecord

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v2_debug_fsdp2_step3"
GROUP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0}
MUON_GROUP = {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True,
              "ns_coefficients": [3.4445, -4.775, 2.0315], "ns_steps": 5, "eps": 1e-7, "adjust_lr_fn": None,
              "normuon": False, "normuon_beta2": 0.95, "normuon_eps": 1e-8}


def _tensor(shape, dtype=torch.float32):
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])


def _records(header: schema_records.Header, gefen_fqns=(), muon_fqns=()):
    """(entries, small values) of a checkpoint whose parameters (8 x 8) have no state yet."""
    values = {schema.header_key(): header.to_json()}
    if gefen_fqns:
        rec = gefen_records.OptimizerRecord(False, 0, [gefen_records.ParamRecord(f, (8, 8), 0, 0, 0, GROUP)
                                                        for f in gefen_fqns])
        values[gefen_keys.optimizer_key(gefen_fqns[0])] = rec.to_json()
    if muon_fqns:
        rec = MuonOptimizerRecord(False, 0, [MuonParamRecord(f, (8, 8), 0, 0, 0, dict(MUON_GROUP)) for f in muon_fqns])
        values[muon_keys.muon_optimizer_key(muon_fqns[0])] = rec.to_json()
    return {n: None for n in values}, values


def _whats(entries, values):
    saved = record_checks.read_saved(entries, values)
    return [what for _, _, what in saved.checked], saved


def test_sound_records_of_two_kinds_pass_and_each_kind_reads_its_own():
    whats, saved = _whats(*_records(schema_records.Header.for_blocking("agreed"), ("a",), ("b",)))
    assert whats == [] and sorted(saved.kinds) == ["Gefen", "GefenMuon"]
    assert [p.fqn for p in saved.kinds["GefenMuon"].params] == ["b"]


def test_a_parameter_with_records_of_two_kinds_is_refused():
    whats, _ = _whats(*_records(schema_records.Header.for_blocking("agreed"), ("a", "b"), ("b",)))
    assert whats == ["b has records in gefen/optimizer/a and gefen/muon/b"]


def test_a_kinds_state_in_a_format_it_does_not_write_is_refused():
    whats, saved = _whats(*_records(schema_records.Header.for_blocking("per_rank"), (), ("b",)))
    assert whats == ["gefen/muon/b: GefenMuon state in a format v1 checkpoint (GefenMuon writes v2, v3, v4)"]
    assert "GefenMuon" not in saved.kinds


def test_a_state_tensor_of_no_record_is_refused():
    entries, values = _records(schema_records.Header.for_blocking("agreed"), ("a",))
    entries[gefen_keys.grid_key("ghost")] = _tensor((8, 2, 2))
    whats, _ = _whats(entries, values)
    assert whats == ["gefen/grid/ghost belongs to no optimizer record"]


def test_a_description_cannot_take_another_kinds_key_kinds():
    gefen = registry.get("Gefen").checkpoint
    with pytest.raises(ValueError, match="is described already"):
        kinds.register(gefen)
    with pytest.raises(ValueError, match=r"\['muon'\]"):
        kinds.register(kinds.KindDescription("Other", (schema.KeyRow("muon", "gefen/other/{opt}"),), gefen.read,
                                              gefen.versions))
    assert [d.name for d in kinds.descriptions()] == ["Gefen", "GefenMuon"]


@pytest.mark.filterwarnings("ignore:.*single process:UserWarning")
def test_the_stored_checkpoints_gefen_record_is_key_kind_gefen():
    """The v2 checkpoint that earlier code wrote (tests/fixtures; never regenerated) keeps Gefen's record
    under ``gefen/optimizer/{its first parameter}``: that key is key kind "gefen", and Gefen's description
    reads it as before (every parameter, no problem, nothing unknown)."""
    md = storage.read_metadata(FIXTURE)
    entries = {k.partition(".")[2]: v for k, v in md.state_dict_metadata.items() if k.startswith("optimizer.")}
    names = record_checks.small_names(entries)
    record = "gefen/optimizer/tok_embeddings.weight"
    assert names == ["gefen/codebook/tok_embeddings.weight", "gefen/format", record]
    assert schema.parse_key(record) == schema.Key("gefen", "tok_embeddings.weight")
    strings = [n for n in names if schema.SMALL_KINDS[schema.parse_key(n).kind] == "str"]
    values = storage.read_small(str(FIXTURE), md, "optimizer.", [n for n in names if n not in strings], strings)
    whats, saved = _whats(entries, values)
    assert whats == [] and list(saved.kinds) == ["Gefen"], whats
    (o,) = saved.kinds["Gefen"].optimizers
    assert o.opt == "tok_embeddings.weight" and o.params[0].fqn == o.opt and len(o.params) == 45
    assert set(saved.kinds["Gefen"].owner.values()) == {record}


# The records' JSON is the format (ranks compare its bytes; v2 and v3 checkpoints hold it): one record of each
# kind, pinned to the text these versions write. Group values of other types are written as JSON floats.
GEFEN_JSON = (
    '{"blocking": "agreed", "deterministic": true, "global_step": 7, "params": [{"fqn": "layers.0.w", "group": '
    '{"beta1": 0.9, "beta2": 0.99, "eps": 1e-08, "lr": 0.001, "weight_decay": 0.0}, "period": 4, "shape": [8, 16], '
    '"step": 7, "vmean_step": 6}, {"fqn": "norm.w", "group": {"beta1": 0.9, "beta2": 0.99, "eps": 1e-08, '
    '"lr": 0.001, "weight_decay": 0.0}, "period": 0, "shape": [16], "step": 0, "vmean_step": 0}]}')
MUON_JSON = (
    '{"blocking": "agreed", "deterministic": false, "global_step": 9, "kind": "GefenMuon", "params": [{"fqn": '
    '"experts.w1", "group": {"adjust_lr_fn": null, "eps": 1e-07, "lr": 0.02, "momentum": 0.95, "nesterov": true, '
    '"normuon": true, "normuon_beta2": 0.95, "normuon_eps": 1e-08, "ns_coefficients": [3.4445, -4.775, 2.0], '
    '"ns_steps": 5, "weight_decay": 0.0}, "period": 8, "rows_step": 4, "shape": [2, 8, 16], "step": 9}]}')


def test_each_kinds_record_writes_and_reads_the_pinned_json():
    group = {**GROUP, "weight_decay": 0}
    gefen = gefen_records.OptimizerRecord(True, 7, [gefen_records.ParamRecord("layers.0.w", (8, 16), 4, 7, 6, group),
                                                     gefen_records.ParamRecord("norm.w", (16,), 0, 0, 0, group)])
    muon_group = {**MUON_GROUP, "weight_decay": 0, "ns_coefficients": (3.4445, -4.775, 2), "normuon": True}
    muon = MuonOptimizerRecord(False, 9, [MuonParamRecord("experts.w1", (2, 8, 16), 8, 9, 4, muon_group)])
    assert gefen.to_json() == GEFEN_JSON and muon.to_json() == MUON_JSON

    back = gefen_records.OptimizerRecord.from_json(GEFEN_JSON, "layers.0.w")
    assert (back.deterministic, back.global_step, back.blocking) == (True, 7, "agreed")
    assert [(p.fqn, p.shape, p.period, p.step, p.vmean_step) for p in back.params] == [
        ("layers.0.w", (8, 16), 4, 7, 6), ("norm.w", (16,), 0, 0, 0)]
    assert back.params[0].grid == (8, 4) and back.params[1].grid is None and back.to_json() == GEFEN_JSON
    back_muon = MuonOptimizerRecord.from_json(MUON_JSON, "experts.w1")
    assert (back_muon.deterministic, back_muon.global_step, back_muon.kind) == (False, 9, "GefenMuon")
    (p,) = back_muon.params
    assert (p.fqn, p.shape, p.period, p.step, p.rows_step, p.grid) == ("experts.w1", (2, 8, 16), 8, 9, 4, (2, 8, 2))
    assert back_muon.to_json() == MUON_JSON

    refused = [(gefen_records.OptimizerRecord, MUON_JSON.replace("agreed", "per_rank"),
                "optimizer record o is not an agreed-blocking record"),
               (MuonOptimizerRecord, GEFEN_JSON, "GefenMuon record o is not an agreed-blocking GefenMuon record"),
               (MuonOptimizerRecord, MUON_JSON.replace('"step": 9', '"stp": 9'),
                "GefenMuon record o is corrupt \\(field 'step' missing\\)")]
    for reader, text, what in refused:
        with pytest.raises(schema.FormatError, match=what):
            reader.from_json(text, "o")
