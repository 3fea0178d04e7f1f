"""docs/checkpoint_format.md shows exactly the key tables the code writes."""

from pathlib import Path

import pytest

from gefen_titan.checkpoint import schema as fmt

DOC = (Path(__file__).resolve().parents[2] / "docs" / "checkpoint_format.md").read_text()


@pytest.mark.parametrize("version", sorted(fmt.KEYS))
def test_doc_key_table_matches_code(version):
    assert fmt.key_table(version) in DOC, (
        f"docs/checkpoint_format.md's v{version} key table differs from gefen_titan.checkpoint.schema.KEYS; "
        "paste format.key_table(%d) into the doc" % version)


def test_key_builders_use_the_table():
    assert fmt.codes_key("a.b") == "gefen/codes/a.b"
    assert fmt.magnitude_key("a.b") == "gefen/magnitude/a.b"
    assert fmt.vmean_key("a.b") == "gefen/vmean/a.b"
    assert fmt.codebook_key("o") == "gefen/codebook/o"
    assert fmt.records_key("o", 3) == "gefen/records/o/3"
    assert fmt.blocks_key("o", 3) == "gefen/blocks/o/3"
    assert fmt.rank_codebook_key("o", 3) == "gefen/codebook/o/3"
    assert fmt.grid_key("a.b") == "gefen/grid/a.b"
    assert fmt.VERSION == 3 and fmt.V2 == 2 and fmt.V1 == 1
    assert f"`gefen-titan` v{fmt.VERSION}" in DOC
