"""``ckpt convert``'s options, shared by both directions (``convert``, ``convert_to_gefen``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConvertOptions"]


@dataclass(frozen=True)
class ConvertOptions:
    implementation: str = "fused"  # --to adamw: torchtitan's optimizer.implementation
    max_tensor_parallel_degree: int = 1  # --to gefen: as the recipe's optimizer setting
    period_one_substrings: tuple[str, ...] = ()
    deterministic: bool = False
    second_moment: str = "factored"  # --to gefen: as the recipe's optimizer.gefen.second_moment ("block": vmean only)
