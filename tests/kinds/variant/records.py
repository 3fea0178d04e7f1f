"""Variant's record: Gefen's, with a ``kind`` (so neither kind's reader takes the other's record)."""

from __future__ import annotations

import json

from gefen_titan.checkpoint.format import schema, schema_records
from gefen_titan.optim.kinds.gefen import records as gefen_records

KIND = "Variant"


class VariantRecord(gefen_records.OptimizerRecord):

    def to_json(self) -> str:
        return json.dumps({"kind": KIND, **json.loads(super().to_json())}, sort_keys=True)

    @classmethod
    def from_json(cls, raw, opt):
        data = schema_records.loads_json(raw, f"variant record {opt}")
        if data.pop("kind", None) != KIND:
            raise schema.FormatError(f"variant record {opt} is not a Variant record")
        rec = gefen_records.OptimizerRecord.from_json(json.dumps(data), opt)
        return cls(rec.deterministic, rec.global_step, rec.params)
