"""sdpa_attention: config override that runs attention through SDPA on CPU.

Not a monkeypatch and not applied by ``apply_all()``: this is a torchtitan
``@override`` (see ``torchtitan/config/override.py``) that a recipe activates::

    [override]
    imports = ["gefen_titan.patches.sdpa_attention.sdpa_attention"]

or, for configs built in Python, :func:`use_sdpa_attention`.

Why it is needed
    FlexAttention has no CPU backward; the first backward on CPU fails with::

        NotImplementedError: FlexAttention does not support backward on CPU.
        Please set the input requires_grad to False or use another device.

    and torchtitan 0.3.0 no longer accepts the SDPA backend for language models:
    ``model_registry("debugmodel", attn_backend="sdpa")`` raises::

        ValueError: sdpa is no longer supported for language models; positions
        are always available so use flex, flex_flash, or varlen.

    ("varlen" needs CUDA flash attention.) So a CPU run has to replace each
    ``FlexAttention.Config`` (inner attention) in the built model config with
    ``ScaledDotProductAttention.Config``.

Tensor parallelism
    The replacement keeps the Flex config's ``sharding_config`` (and
    ``param_init``). torchtitan's ``update_from_config`` runs *before*
    overrides and gives every inner attention a ``LocalMapConfig``
    (``set_gqa_inner_attention_local_map``): ``Module.parallelize`` then wraps
    its ``forward`` in ``local_map`` over the TP mesh, q/k/v/out ``Shard(2)``
    (heads), so SDPA runs on each rank's heads as plain tensors and the output
    is a head-sharded DTensor again (the ``spmd_types`` backend uses the
    spmd ``local_map`` instead). The first
    version of this override built a bare ``ScaledDotProductAttention.Config()``
    and so dropped that local_map; with TP > 1 SDPA then received DTensors and
    the first forward failed on CPU with::

        NotImplementedError: Operator
        aten._scaled_dot_product_flash_attention_for_cpu.default does not have
        a sharding strategy registered.

    (forcing the MATH backend failed too, on mixed Tensor/DTensor operands).
    Measured on a 2-rank gloo TP mesh: output and q/k/v grads equal to
    single-device SDPA (max |diff| 0.0; tests/integration/test_meshes_cpu.py allows 1e-6
    for the grads); FSDP 2 x TP 2 step-1 loss equal to FSDP 2's on the same
    data (8.08185 both). The same holds where the override is active on
    CUDA (``cpu_only=False``): the kernel only ever sees local tensors, whether
    or not DTensor has a strategy for it. Placements the inner attention does
    not declare are not handled here: a model whose inner attention has no
    sharding config gets DTensor's own SDPA rules, as upstream.

Semantics
    SDPA is plain causal attention (``is_causal=True``): in sequences packed
    from several documents, tokens attend across document boundaries, where
    FlexAttention applies a block-causal per-document mask. RoPE positions still
    restart per document. Fine for CPU smoke/CI runs; not loss-identical to a
    GPU run with FlexAttention.

Scope
    With the default ``cpu_only=True`` the swap happens only when no accelerator
    is available, so the same recipe keeps FlexAttention on CUDA. Pass
    ``{"cpu_only": false}`` as override kwargs to force SDPA everywhere.

Upstream status
    Deliberate upstream change (torchtitan 0.3.0 dropped SDPA for LMs); FlexAttention
    CPU backward is unsupported as of torch 2.13. Carrying ``sharding_config``
    over is what torchtitan's own overrides do (e.g. ``overrides/fused_swiglu``).
"""

from __future__ import annotations

from . import check_versions

check_versions()  # this module imports torchtitan internals at import time: refuse other versions first

from torchtitan.config import override  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)

from ._util import PatchTargetChanged  # noqa: E402

try:
    ScaledDotProductAttention.Config()
except TypeError as e:  # grew required fields upstream
    raise PatchTargetChanged(
        f"gefen_titan.patches.sdpa_attention: ScaledDotProductAttention.Config() "
        f"can no longer be built without arguments: {e}"
    ) from e
for _cls in (FlexAttention.Config, ScaledDotProductAttention.Config):
    if not {"param_init", "sharding_config"} <= set(getattr(_cls, "__dataclass_fields__", {})):
        raise PatchTargetChanged(
            f"gefen_titan.patches.sdpa_attention: {_cls.__qualname__} no longer has "
            "the Module.Config fields param_init/sharding_config this override carries over"
        )
del _cls


def _no_accelerator() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


@override(
    target=FlexAttention.Config,
    exact=True,
    description="CPU: FlexAttention has no CPU backward; use SDPA (plain causal).",
)
def sdpa_attention(cfg: FlexAttention.Config, *, cpu_only: bool = True):
    if cpu_only and not _no_accelerator():
        return cfg
    return _sdpa_config_like(cfg)


def _sdpa_config_like(cfg: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    """An SDPA config that keeps ``cfg``'s ``Module.Config`` fields.

    ``sharding_config`` is what makes tensor parallelism work: torchtitan's
    ``update_from_config`` (run *before* overrides) installs on the inner
    attention a ``LocalMapConfig`` whose ``Module.parallelize`` wraps
    ``forward`` in ``local_map`` (heads ``Shard(2)`` on TP; k/v ``Replicate``
    on CP, grads ``Partial`` there). Dropping it hands head-sharded DTensors
    to ``F.scaled_dot_product_attention`` directly, which on CPU fails with
    ``NotImplementedError: Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
    sharding strategy registered``. ``param_init`` is carried for completeness
    (attention has no parameters). Flex-only fields (``block_size``,
    ``kernel_options``) have no SDPA meaning and are dropped.
    """
    return ScaledDotProductAttention.Config(
        param_init=cfg.param_init, sharding_config=cfg.sharding_config
    )


def use_sdpa_attention(config, *, cpu_only: bool = True) -> int:
    """Swap every ``FlexAttention.Config`` under ``config`` (a ``Trainer.Config``,
    ``ModelSpec`` or model config) for SDPA, in place. Returns the number swapped
    (0 when ``cpu_only`` and an accelerator is present)."""
    if cpu_only and not _no_accelerator():
        return 0
    hits = [
        (cfg, parent, attr)
        for _fqn, cfg, parent, attr in config.traverse(FlexAttention.Config)
        if type(cfg) is FlexAttention.Config
    ]
    for cfg, parent, attr in hits:
        if parent is None:
            raise ValueError("use_sdpa_attention: the root config is itself FlexAttention")
        new = _sdpa_config_like(cfg)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return len(hits)
