"""Extra Llama 3 flavors, registered with torchtitan's ``llama3`` registry.

Why: every figure the debug model gives (6.16M parameters, dim 256) is
dominated by fixed costs (DCP's per-entry framing, process start-up, the
first step's agreement). ``150M`` is the smallest Llama 3 where bytes
dominate, still trainable on a few CPU cores: dim 1024, 8 layers, 16 heads
with 8 KV heads (GQA, as the real flavors), vocab 32768, SwiGLU hidden 2816
(``compute_ffn_hidden_dim(1024, multiple_of=256)``), 161.5M parameters. It
is built from torchtitan's own layer builder, so its parameters, names,
sharding and initialisation are those of the shipped flavors.

``register_flavors()`` (run by the recipe layer before it resolves a llama3
flavor, and by the benchmarks) adds it to
``torchtitan.models.llama3.llama3_configs``, so ``[model] flavor = "150M"``
and ``model_registry("150M")`` work like any torchtitan flavor.

Uses torchtitan 0.3.0's private llama3 builders on purpose
(``_build_llama3_layers``, ``_EMBEDDING_INIT``, ``_NORM_INIT``,
``_output_linear_init``): they are what make the flavor a shipped one in all
but size. Importing this module imports ``torchtitan.models.llama3``
(seconds), so the recipe layer imports it only for llama3 recipes.
"""

from __future__ import annotations

from torchtitan.models import llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.llama3 import Llama3Model

__all__ = ["FLAVORS", "register_flavors"]


def _150m(attn_backend: str, tp_gemm_backend: str = "default"):
    dim, n_heads, n_kv_heads, n_layers, vocab = 1024, 16, 8, 8, 32768
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT  # noqa: SLF001
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),  # noqa: SLF001
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)  # noqa: SLF001
        ),
        layers=llama3._build_llama3_layers(  # noqa: SLF001
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend=attn_backend,
            tp_gemm_backend=tp_gemm_backend,
        ),
    )


FLAVORS = {"150M": _150m}


def register_flavors() -> None:
    """Add ``FLAVORS`` to torchtitan's llama3 registry (idempotent)."""
    for name, fn in FLAVORS.items():
        existing = llama3.llama3_configs.get(name)
        if existing is not None and existing is not fn:
            raise RuntimeError(f"torchtitan already has a llama3 flavor {name!r}; gefen_titan would shadow it")
        llama3.llama3_configs[name] = fn
