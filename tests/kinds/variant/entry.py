"""Variant's registry entry (``spec()``), registered by the tests that use the kind."""

from __future__ import annotations

from gefen_titan.optim import registry
from gefen_titan.optim.kinds.groups import split_options
from tests.kinds.variant import description
from tests.kinds.variant.options import VariantOptions
from tests.kinds.variant.records import KIND
from tests.kinds.variant.sharded import Variant, VariantShardedAdapter

OPTION_KEYS = ("deterministic",)


def build_variant(param_groups, **factory_kwargs):
    """Its groups' parameters and lr; its table's options (the container fills them into every group) as
    constructor options. No factored second moment (gefen-titan's rule); periods and codebook from the
    agreement."""
    groups, options = split_options(param_groups, OPTION_KEYS, KIND)
    return Variant(groups, factored_v_2d=False, **options, **factory_kwargs)


def spec() -> registry.OptimizerSpec:
    return registry.OptimizerSpec(
        name=KIND, factory=build_variant, owns=VariantShardedAdapter.owns, group_keys=("lr",), shorthand_keys=("lr",),
        option_keys=OPTION_KEYS, options="variant", options_type=VariantOptions,
        state=lambda optimizers, options: VariantShardedAdapter(optimizers),
        record_kind=VariantShardedAdapter.record_kind,
        agreed_blocking=True, codebook_family=registry.codebook_families(),  # a family of its own
        checkpoint=description.description())
