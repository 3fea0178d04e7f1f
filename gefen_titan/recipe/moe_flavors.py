"""Small Qwen3 mixture-of-experts flavors, registered with torchtitan's ``qwen3`` registry.

Why: torchtitan 0.3.0's smallest Qwen3 MoE, ``debugmodel_moe`` (8 layers, 64
experts of hidden 768, top-8, 315.8M parameters, 96% of them in the routed
experts), takes ~105 s a step on 2 CPU ranks here, so no CI run can train it.
These flavors keep its shape of model (Qwen3 blocks, every block an MoE of
grouped ``w1_EFD``/``w2_EDF``/``w3_EFD`` experts, a softmax top-k router with
``route_norm``, torchtitan's load-balancing ``expert_bias_E``) at a size a
CPU trains in about a second a step:

* ``debugmodel_moe_8e``: the default of ``recipes/qwen3_moe_gefen.toml``.
  dim 256, 4 layers, 4 heads of 64 with 2 KV heads, vocab 2048, 8 experts of
  hidden 256, top-2: 8.07M parameters, 6.29M (78%) of them routed experts.
  8 experts give every expert-parallel degree up to 8 whole experts per rank.
* ``debugmodel_moe_2e``: the same with 2 experts, top-1 (2.61M parameters).
  With so few experts torchtitan's FSDP cuts the experts along their hidden
  dimension instead: ``Shard(1)`` whenever efsdp x ep > num_experts
  (``torchtitan/distributed/fsdp.py``), e.g. EP 1 x FSDP 4 or EP 2 x efsdp 2
  at 4 ranks, so tests of that placement can train a model that has it.
  Top-1 so that routing still chooses (top-2 of 2 would send every token to
  both experts and the load-balancing bias would never move).

Both are built from torchtitan's own Qwen3 builders
(``_build_qwen3_moe_layers``, ``_qwen3_norm``, ``_EMBEDDING_INIT``,
``_LINEAR_INIT``, private in torchtitan 0.3.0 on purpose: they are what make
a flavor a shipped one in all but size), so names, sharding, routing and
initialisation are those of ``debugmodel_moe``. ``register_flavors()`` (run by
the recipe layer before it resolves a qwen3 flavor) adds them to
``torchtitan.models.qwen3.qwen3_configs``, so ``[model] flavor =
"debugmodel_moe_8e"`` and ``model_registry("debugmodel_moe_8e")`` work like
any torchtitan flavor. Importing this module imports
``torchtitan.models.qwen3`` (seconds): the recipe layer imports it only for
qwen3 recipes.
"""

from __future__ import annotations

from functools import partial

from torchtitan.models import deepseek_v3, qwen3
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.qwen3 import Qwen3Model

__all__ = ["FLAVORS", "qwen3_moe", "register_flavors"]


def qwen3_moe(attn_backend: str = "flex", moe_comm_backend: str = "standard", *, num_experts: int, top_k: int,
              dim: int = 256, n_layers: int = 4, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 64,
              vocab: int = 2048, moe_hidden_dim: int = 256) -> Qwen3Model.Config:
    """A Qwen3 MoE config of any size, from torchtitan's builders (the defaults: ``debugmodel_moe_8e``'s)."""
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),  # noqa: SLF001
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT  # noqa: SLF001
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),  # noqa: SLF001
        layers=qwen3._build_qwen3_moe_layers(  # noqa: SLF001
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            moe_hidden_dim=moe_hidden_dim,
            num_experts=num_experts,
            top_k=top_k,
            attn_backend=attn_backend,
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0),
            moe_comm_backend=moe_comm_backend,
        ),
    )


def _dsv3_small(attn_backend: str, moe_comm_backend: str, non_blocking_capacity_factor: float | None = None,
                num_mtp_layers: int = 0) -> DeepSeekV3Model.Config:
    dim, vocab, rope_dim = 256, 2048, 32
    layers = deepseek_v3._build_dsv3_layers(  # noqa: SLF001
        n_layers=4,
        n_dense_layers=1,
        dim=dim,
        n_heads=4,
        q_lora_rank=0,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=rope_dim,
        v_head_dim=64,
        mscale=0.70,
        dense_hidden_dim=512,
        moe_hidden_dim=256,
        num_experts=8,
        num_shared_experts=2,
        router_top_k=3,
        router_score_func="softmax",
        attn_backend=attn_backend,
        moe_comm_backend=moe_comm_backend,
        non_blocking_capacity_factor=non_blocking_capacity_factor,
        # debugmodel's YaRN RoPE, at the smaller rope head dim.
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=4096 * 4, theta=10000.0, scaling="yarn",
                                rope_factor=40.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=4096),
    )
    return DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=deepseek_v3._EMBEDDING_INIT  # noqa: SLF001
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=deepseek_v3._NORM_INIT),  # noqa: SLF001
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=deepseek_v3._output_linear_init(dim)  # noqa: SLF001
        ),
        layers=layers,
        mtp_layers=deepseek_v3._build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=num_mtp_layers),  # noqa: SLF001
    )


# torchtitan model package -> (its flavor registry's name, gefen-titan's flavors for it).
FLAVORS = {
    "qwen3": ("qwen3_configs", {
        "debugmodel_moe_8e": partial(qwen3_moe, num_experts=8, top_k=2),
        "debugmodel_moe_2e": partial(qwen3_moe, num_experts=2, top_k=1),
    }),
    "deepseek_v3": ("deepseekv3_configs", {"debugmodel_small": _dsv3_small}),
}


def register_flavors() -> None:
    """Add ``FLAVORS`` to torchtitan's qwen3 and deepseek_v3 registries (idempotent)."""
    for package, (registry_name, flavors) in FLAVORS.items():
        registry = getattr({"qwen3": qwen3, "deepseek_v3": deepseek_v3}[package], registry_name)
        for name, fn in flavors.items():
            existing = registry.get(name)
            if existing is not None and existing is not fn:
                raise RuntimeError(
                    f"torchtitan already has a {package} flavor {name!r}; gefen_titan would shadow it")
            registry[name] = fn
