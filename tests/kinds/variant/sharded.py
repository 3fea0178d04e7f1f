"""Variant's state adapter: Gefen's hooks (formats v3/v2) under its own name, owner and key kinds."""

from __future__ import annotations

from gefen import Gefen

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim.kinds.gefen.sharded import GefenShardedAdapter
from tests.kinds.variant import keys
from tests.kinds.variant.records import KIND, VariantRecord


class Variant(Gefen):
    """The optimizer: Gefen, by another type (the registry owns optimizers by exact type)."""


class VariantShardedAdapter(GefenShardedAdapter):
    kind = KIND
    owns = staticmethod(lambda o: type(o) is Variant)
    record_kind, codebook_kind, codebook_what = keys.RECORD_KIND, keys.CODEBOOK_KIND, "Variant codebook"

    def _optimizer_record(self, optim, params):
        return VariantRecord(gx.options(optim)["deterministic"], gx.global_step(optim), params)
