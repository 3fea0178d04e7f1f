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
    CPU backward is unsupported as of torch 2.13.
"""

from __future__ import annotations

from . import check_versions

check_versions()  # this module imports torchtitan internals at import time

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
    return ScaledDotProductAttention.Config()


def use_sdpa_attention(config, *, cpu_only: bool = True) -> int:
    """Swap every ``FlexAttention.Config`` under ``config`` (a ``Trainer.Config``,
    ``ModelSpec`` or model config) for SDPA, in place. Returns the number swapped
    (0 when ``cpu_only`` and an accelerator is present)."""
    if cpu_only and not _no_accelerator():
        return 0
    hits = [
        (parent, attr)
        for _fqn, cfg, parent, attr in config.traverse(FlexAttention.Config)
        if type(cfg) is FlexAttention.Config
    ]
    for parent, attr in hits:
        if parent is None:
            raise ValueError("use_sdpa_attention: the root config is itself FlexAttention")
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return len(hits)
