"""cpu_grouped_mm: config override that runs the MoE experts' grouped GEMMs in fp32 kernels on CPU.

Not a monkeypatch and not applied by ``apply_all()``: a torchtitan ``@override``
(``torchtitan/config/override.py``) that a recipe activates, as
``sdpa_attention``::

    [override]
    imports = ["gefen_titan.patches.sdpa_attention.sdpa_attention",
               "gefen_titan.patches.cpu_grouped_mm.cpu_grouped_mm"]

Why it is needed
    torchtitan 0.3.0's ``GroupedExperts.forward`` (the routed experts of every
    MoE model: DeepSeek-V3, Qwen3 MoE, ...) casts the tokens and the expert
    weights to bfloat16 and calls ``torch._grouped_mm`` on them, whatever the
    parameter dtype. torch 2.13's CPU ``_grouped_mm`` is slow in bfloat16:
    measured here (one thread, 8 experts, 1024 rows, 256 x 256), 18.0 ms a
    call against 4.0 ms in fp32 (4.5x). It dominated a CPU step: a 1-rank
    step of ``recipes/qwen3_moe_gefen.toml`` (local batch 2, seq 256) took
    3.5 s, and 0.9 s with this override.

What it changes
    The grouped GEMM's kernel only: on CPU inputs it upcasts the bfloat16
    operands it is given to fp32, runs ``torch._grouped_mm`` in fp32 and casts
    the result back to the input dtype. The operands keep torchtitan's
    bfloat16 rounding and the output is rounded to bfloat16 as before, so the
    math is the model's: the bfloat16 kernel also accumulates in fp32, and the
    two differ in the order of the sums only (measured: 0.008% of outputs one
    bfloat16 ulp apart; 5-step losses of the Qwen3 MoE recipe within 3e-4).
    Gradients flow through the casts as through torchtitan's own.

Scope
    ``cpu_only=True`` (the default): the override swaps the config only where
    no accelerator is available, and the swapped module still calls
    torchtitan's own ``_grouped_mm`` for non-CPU tensors. Only configs of
    exactly ``GroupedExperts.Config`` are swapped: subclasses (gpt-oss's
    experts, the fused-SwiGLU and low-precision converters) keep theirs.

Upstream status
    Deliberate upstream choice (bfloat16 grouped GEMMs are the GPU fast path);
    torch 2.13's CPU grouped GEMM has no fast bfloat16 kernel.
"""

from __future__ import annotations

from . import check_versions

check_versions()  # this module imports torchtitan internals at import time: refuse other versions first

import dataclasses  # noqa: E402

import torch  # noqa: E402
from torchtitan.config import derive, override  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

from ._util import PatchTargetChanged  # noqa: E402

if not callable(getattr(GroupedExperts, "_grouped_mm", None)):
    raise PatchTargetChanged(
        "gefen_titan.patches.cpu_grouped_mm: torchtitan's GroupedExperts no longer has the "
        "_grouped_mm(A=, B_t=, offs=) seam this override replaces"
    )

__all__ = ["CpuGroupedExperts", "cpu_grouped_mm", "use_cpu_grouped_mm"]


def _no_accelerator() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


class CpuGroupedExperts(GroupedExperts):
    """torchtitan's grouped experts whose grouped GEMM runs an fp32 kernel on CPU tensors."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if A.device.type != "cpu":
            return super()._grouped_mm(A=A, B_t=B_t, offs=offs)
        return torch._grouped_mm(A.float(), B_t.float(), offs=offs).to(A.dtype)


@override(
    target=GroupedExperts.Config,
    exact=True,
    description="CPU: MoE grouped GEMMs through the fp32 kernel (bf16 operands and result kept).",
)
def cpu_grouped_mm(cfg: GroupedExperts.Config, *, cpu_only: bool = True):
    if cpu_only and not _no_accelerator():
        return cfg
    return derive(cfg, CpuGroupedExperts.Config)


def use_cpu_grouped_mm(config, *, cpu_only: bool = True) -> int:
    """Swap every ``GroupedExperts.Config`` under ``config`` (a ``Trainer.Config``,
    ``ModelSpec`` or model config) for ``CpuGroupedExperts.Config``, in place.
    Returns the number swapped (0 when ``cpu_only`` and an accelerator is present)."""
    if cpu_only and not _no_accelerator():
        return 0
    hits = [
        (cfg, parent, attr)
        for _fqn, cfg, parent, attr in config.traverse(GroupedExperts.Config)
        if type(cfg) is GroupedExperts.Config
    ]
    for cfg, parent, attr in hits:
        if parent is None:
            raise ValueError("use_cpu_grouped_mm: the root config is itself GroupedExperts")
        new = derive(cfg, CpuGroupedExperts.Config)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return len(hits)
