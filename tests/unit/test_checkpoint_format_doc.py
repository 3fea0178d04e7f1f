"""docs/checkpoint_format.md shows exactly the key tables the code writes."""

from pathlib import Path

import pytest

from gefen_titan.checkpoint import schema, schema_doc

DOC = (Path(__file__).resolve().parents[2] / "docs" / "checkpoint_format.md").read_text()


@pytest.mark.parametrize("version", sorted(schema_doc.KEYS))
def test_doc_key_table_matches_code(version):
    assert schema_doc.key_table(version) in DOC, (
        f"docs/checkpoint_format.md's v{version} key table differs from gefen_titan.checkpoint.schema_doc.KEYS; "
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
