"""A torchtitan override for LoRA runs on CPU: SDPA for LoRA's frozen FlexAttention.

LoRA (``torchtitan.components.lora``) rebuilds every module config it does
not adapt as a frozen subclass of its class, the inner attention's
``FlexAttention.Config`` included. The recipes' CPU override
(``gefen_titan.patches.sdpa_attention``) claims ``FlexAttention.Config`` with
``exact=True``, so it leaves the frozen subclass alone, and FlexAttention,
which has no CPU backward, then fails the first backward of any adapter
upstream of an attention (every one but the last layer's). This override
matches the subclasses too and builds the same SDPA config as that patch
(plain causal attention, the Flex config's ``sharding_config`` and
``param_init`` kept); a LoRA recipe lists it in place of the patch's::

    [override]
    imports = ["tests.helpers.lora_attention.sdpa_attention_any_flex"]

Test-only: it imports as ``tests.helpers...``, so ranks must run from the
checkout's root (torchrun ``-m gefen_titan.train`` there).
"""

from __future__ import annotations

from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention


@override(target=FlexAttention.Config, description="tests, CPU: FlexAttention (LoRA's frozen subclass too) -> SDPA")
def sdpa_attention_any_flex(cfg: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    return ScaledDotProductAttention.Config(param_init=cfg.param_init, sharding_config=cfg.sharding_config)
