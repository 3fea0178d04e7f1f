"""The format's keys: docs/checkpoint_format.md shows exactly the key tables the code writes, the keys
are what every version wrote, and the key kinds code names map to them one to one."""

import re
from pathlib import Path

import pytest

from gefen_titan.checkpoint.format import schema, schema_doc
from gefen_titan.optim.kinds.gefen import keys as gefen_keys

DOC = (Path(__file__).resolve().parents[2] / "docs" / "checkpoint_format.md").read_text()


@pytest.mark.parametrize("version", sorted(schema_doc.keys()))
def test_doc_key_table_matches_code(version):
    assert schema_doc.key_table(version) in DOC, (
        f"docs/checkpoint_format.md's v{version} key table differs from checkpoint.format.schema_doc.keys(); "
        "paste schema_doc.key_table(%d) into the doc" % version)


def test_key_builders_use_the_table():
    assert gefen_keys.codes_key("a.b") == "gefen/codes/a.b"
    assert gefen_keys.magnitude_key("a.b") == "gefen/magnitude/a.b"
    assert gefen_keys.vmean_key("a.b") == "gefen/vmean/a.b"
    assert gefen_keys.codebook_key("o") == "gefen/codebook/o"
    assert gefen_keys.records_key("o", 3) == "gefen/records/o/3"
    assert gefen_keys.blocks_key("o", 3) == "gefen/blocks/o/3"
    assert gefen_keys.rank_codebook_key("o", 3) == "gefen/codebook/o/3"
    assert gefen_keys.grid_key("a.b") == "gefen/grid/a.b"
    assert gefen_keys.vrow_key("a.b") == "gefen/vrow/a.b" and gefen_keys.vcol_key("a.b") == "gefen/vcol/a.b"
    assert schema.VERSION == 4 and schema.V3 == 3 and schema.V2 == 2 and schema.V1 == 1
    assert f"`gefen-titan` v{schema.VERSION}" in DOC


def test_gefens_records_keep_their_key_as_kind_gefen():
    """Gefen's records are key kind "gefen" in code (as GefenMuon's are "muon") and keep the key every
    version wrote, ``gefen/optimizer/{its first parameter}``: the kind's name is not the key's segment."""
    assert gefen_keys.optimizer_key("tok_embeddings.weight") == "gefen/optimizer/tok_embeddings.weight"
    assert schema.entry_key("gefen", "tok_embeddings.weight") == "gefen/optimizer/tok_embeddings.weight"
    assert schema.parse_key("gefen/optimizer/tok_embeddings.weight") == schema.Key("gefen", "tok_embeddings.weight")
    assert schema.parse_key("gefen/gefen/tok_embeddings.weight") is None
    with pytest.raises(ValueError, match="no key kind keyed by one name"):
        schema.entry_key("optimizer", "tok_embeddings.weight")


def test_every_kind_keyed_by_one_name_parses_back_from_its_pattern():
    named = [kind for kind, pattern in schema.PATTERNS.items() if pattern.count("{") == 1]
    assert len(named) == 14, named
    for kind in named:
        key = schema.PATTERNS[kind].format(opt="a.b", fqn="a.b")
        assert schema.entry_key(kind, "a.b") == key and schema.parse_key(key) == schema.Key(kind, "a.b"), kind


@pytest.fixture
def rows_restored():
    """Rows registered by a test are dropped after it."""
    before = dict(schema.PATTERNS)
    yield
    schema.unregister_rows([k for k in schema.PATTERNS if k not in before])
    assert schema.PATTERNS == before


@pytest.mark.parametrize(("row", "why"), [
    (schema.KeyRow("variant", "gefen/optimizer/{opt}"), "would be another kind's ('gefen')"),  # Gefen's records
    (schema.KeyRow("variant", "gefen/format/{opt}"), "would be another kind's ('header')"),
    (schema.KeyRow("variant", "gefen/codebook/{opt}/{r}"), "would be another kind's ('rank_codebook')"),
    (schema.KeyRow("variant", "gefen/a/b/{opt}"), "is none of"),
    (schema.KeyRow("variant", "gefen//{opt}"), "is none of"),
    (schema.KeyRow("codes", "gefen/variant/{fqn}"), "is taken"),
    (schema.KeyRow("variant", "gefen/variant/{opt}", small="bytes"), "small must be"),
    (schema.KeyRow("variant", "gefen/variant/{opt}", small="str", raw=True), "only a parameter's state tensor"),
    (schema.KeyRow("fine", "gefen/other/{opt}"), "key kind 'fine' is given twice"),  # in one registration
    (schema.KeyRow("other", "gefen/fine/{fqn}"), "segment 'fine' given twice"),
])
def test_a_row_whose_keys_would_be_another_kinds_cannot_be_registered(rows_restored, row, why):
    """A row's keys must parse back as its own kind: a segment another row of its shape uses (Gefen's records'
    "optimizer", the header's "format") would parse as that kind, a malformed pattern as no key."""
    before = dict(schema.PATTERNS)
    with pytest.raises(ValueError, match="cannot register key rows: .*" + re.escape(why)):
        schema.register_rows([schema.KeyRow("fine", "gefen/fine/{opt}"), row])
    assert schema.PATTERNS == before  # all or none: the good row is not registered either
    assert schema.parse_key("gefen/optimizer/a.b") == schema.Key("gefen", "a.b")


def test_a_registered_row_parses_and_is_read_as_it_says(rows_restored):
    schema.register_rows([schema.KeyRow("variant", "gefen/variant/{opt}", small="str"),
                          schema.KeyRow("variant_state", "gefen/variant_state/{fqn}", raw=True),
                          schema.KeyRow("variant_rank", "gefen/variant/{opt}/{r}", small="tensor")])
    assert schema.entry_key("variant", "a.b") == "gefen/variant/a.b"
    assert schema.parse_key("gefen/variant_state/a.b") == schema.Key("variant_state", "a.b")
    assert schema.parse_key("gefen/variant/a.b/7") == schema.Key("variant_rank", "a.b", 7)
    assert schema.SMALL_KINDS["variant"] == "str" and "variant_state" not in schema.SMALL_KINDS
    assert schema.is_raw_entry("optimizer.gefen/variant_state/a.b")
    assert not schema.is_raw_entry("optimizer.gefen/variant/a")
    schema.unregister_rows(["variant", "variant_state", "variant_rank"])
    assert schema.parse_key("gefen/variant/a.b") is None and "variant" not in schema.SMALL_KINDS
