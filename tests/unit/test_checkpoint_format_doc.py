"""The format's keys: docs/checkpoint_format.md shows exactly the key tables the code writes, the keys
are what every version wrote, and the key kinds code names map to them one to one."""

from pathlib import Path

import pytest

from gefen_titan.checkpoint.format import schema, schema_doc

DOC = (Path(__file__).resolve().parents[2] / "docs" / "checkpoint_format.md").read_text()


@pytest.mark.parametrize("version", sorted(schema_doc.KEYS))
def test_doc_key_table_matches_code(version):
    assert schema_doc.key_table(version) in DOC, (
        f"docs/checkpoint_format.md's v{version} key table differs from gefen_titan.checkpoint.format.schema_doc.KEYS; "
        "paste schema_doc.key_table(%d) into the doc" % version)


def test_key_builders_use_the_table():
    assert schema.codes_key("a.b") == "gefen/codes/a.b"
    assert schema.magnitude_key("a.b") == "gefen/magnitude/a.b"
    assert schema.vmean_key("a.b") == "gefen/vmean/a.b"
    assert schema.codebook_key("o") == "gefen/codebook/o"
    assert schema.records_key("o", 3) == "gefen/records/o/3"
    assert schema.blocks_key("o", 3) == "gefen/blocks/o/3"
    assert schema.rank_codebook_key("o", 3) == "gefen/codebook/o/3"
    assert schema.grid_key("a.b") == "gefen/grid/a.b"
    assert schema.VERSION == 3 and schema.V2 == 2 and schema.V1 == 1
    assert f"`gefen-titan` v{schema.VERSION}" in DOC


def test_gefens_records_keep_their_key_as_kind_gefen():
    """Gefen's records are key kind "gefen" in code (as GefenMuon's are "muon") and keep the key every
    version wrote, ``gefen/optimizer/{its first parameter}``: the kind's name is not the key's segment."""
    assert schema.optimizer_key("tok_embeddings.weight") == "gefen/optimizer/tok_embeddings.weight"
    assert schema.entry_key("gefen", "tok_embeddings.weight") == "gefen/optimizer/tok_embeddings.weight"
    assert schema.parse_key("gefen/optimizer/tok_embeddings.weight") == schema.Key("gefen", "tok_embeddings.weight")
    assert schema.parse_key("gefen/gefen/tok_embeddings.weight") is None
    with pytest.raises(ValueError, match="no key kind keyed by one name"):
        schema.entry_key("optimizer", "tok_embeddings.weight")


def test_every_kind_keyed_by_one_name_parses_back_from_its_pattern():
    named = [kind for kind, pattern in schema.PATTERNS.items() if pattern.count("{") == 1]
    assert len(named) == 12, named
    for kind in named:
        key = schema.PATTERNS[kind].format(opt="a.b", fqn="a.b")
        assert schema.entry_key(kind, "a.b") == key and schema.parse_key(key) == schema.Key(kind, "a.b"), kind


@pytest.fixture
def kinds_restored(monkeypatch):
    """``register_kinds`` changes the format's tables: copies for the test, the originals back after."""
    monkeypatch.setattr(schema, "PATTERNS", dict(schema.PATTERNS))
    monkeypatch.setattr(schema, "SMALL_KINDS", dict(schema.SMALL_KINDS))
    monkeypatch.setattr(schema, "_NAMED_KINDS", dict(schema._NAMED_KINDS))


@pytest.mark.parametrize("kind", ["optimizer", "format", "a/b", ""])
def test_a_kind_whose_keys_would_be_another_kinds_cannot_be_registered(kinds_restored, kind):
    """A registered kind's keys are ``gefen/{kind}/...``: "optimizer" (Gefen's records' segment) or
    "format" (the header's) would parse as that kind, "a/b" or "" as no key."""
    before = dict(schema.PATTERNS)
    with pytest.raises(ValueError, match=f"cannot register key kind {kind!r}: its keys"):
        schema.register_kinds({kind: "record"})
    assert schema.PATTERNS == before
    assert schema.parse_key("gefen/optimizer/a.b") == schema.Key("gefen", "a.b")


def test_a_registered_kind_is_keyed_by_its_name(kinds_restored):
    schema.register_kinds({"variant": "record", "variant_state": "tensor"})
    assert schema.entry_key("variant", "a.b") == "gefen/variant/a.b"
    assert schema.parse_key("gefen/variant_state/a.b") == schema.Key("variant_state", "a.b")
    assert schema.SMALL_KINDS["variant"] == "str" and "variant_state" not in schema.SMALL_KINDS
