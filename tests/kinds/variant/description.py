"""Variant's checkpoint description: Gefen's reader and rows under its names, its own ``convert`` refusal."""

from __future__ import annotations

import dataclasses

from gefen_titan.checkpoint.format.kinds import KindDescription
from gefen_titan.optim.kinds.gefen import description as gefen_description
from tests.kinds.variant import keys
from tests.kinds.variant.records import KIND, VariantRecord


def description() -> KindDescription:
    described = gefen_description.description(KIND, keys.RECORD_KIND, keys.CODEBOOK_KIND, VariantRecord)
    assert {r.kind for r in described.key_rows} == {r.kind for r in keys.ROWS}
    return dataclasses.replace(described, key_rows=keys.ROWS,
                               convert_refusal="a Variant converts to nothing (a test's kind)")
