"""gloo_reduce_op: keep FSDP2's gradient reduce-scatter on ops gloo supports.

What it fixes
    torchtitan's ``apply_fsdp_to_decoder`` calls
    ``disable_fsdp_gradient_division`` -> ``FSDPModule.set_gradient_divide_factor(1.0)``
    on every FSDP module (torchtitan normalizes the loss by the global token
    count itself). With a factor that differs from the shard-group size, FSDP2's
    ``_get_gradient_divide_factors`` picks ``ReduceOp.PREMUL_SUM(1/factor)`` for
    the gradient reduce-scatter. That op only exists in NCCL; gloo fails the
    first backward with::

        RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo

    (With no custom factor FSDP2 would pick ``ReduceOp.AVG``, which gloo also
    does not implement.)

What it does
    Wraps ``torch.distributed.fsdp._fully_shard._fsdp_collectives
    ._get_gradient_divide_factors``: when the reduce-scatter group (or the HSDP
    all-reduce group) is served by a ``ProcessGroupGloo`` backend for the
    gradient's device, it calls the original with
    ``force_sum_reduction_for_comms=True`` -- the same switch FSDP2 exposes
    publicly as ``FSDPModule.set_force_sum_reduction_for_comms`` and forces for
    MTIA. FSDP then reduces with ``ReduceOp.SUM`` and divides locally by the
    factor (a no-op for torchtitan's factor 1.0), which is numerically the same
    gradient. Wrapping at this decision point covers every FSDP unit, whoever
    set its divide factor.

Scope
    gloo only: for NCCL (or any non-gloo) groups the original function runs with
    the original arguments, so CUDA/NCCL keeps PREMUL_SUM/AVG.

Upstream status
    Unfixed upstream as of torchtitan 0.3.0 / torch 2.13 (FSDP2 only special-cases
    MTIA, not gloo).
"""

from __future__ import annotations

import functools

from ._util import is_marked, mark, require_attr, require_params

NAME = "gloo_reduce_op"

_EXPECTED_PARAMS = [
    "reduce_scatter_group",
    "all_reduce_group",
    "reduce_dtype",
    "device_type",
    "factor",
    "force_sum_reduction_for_comms",
]


def _is_gloo(group, device_type: str) -> bool:
    if group is None:
        return False
    import torch
    import torch.distributed as dist

    gloo_cls = getattr(dist, "ProcessGroupGloo", None)
    if gloo_cls is None:
        return False
    try:
        backend = group._get_backend(torch.device(device_type or "cpu"))
    except Exception:  # no backend registered for that device type
        return False
    return isinstance(backend, gloo_cls)


def apply() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    original = require_attr(coll, "_get_gradient_divide_factors")
    require_attr(coll, "foreach_reduce")  # the caller that reads it as a global
    if is_marked(original):
        return True
    require_params(
        original,
        _EXPECTED_PARAMS,
        "torch.distributed.fsdp._fully_shard._fsdp_collectives._get_gradient_divide_factors",
    )

    @functools.wraps(original)
    def _get_gradient_divide_factors(
        reduce_scatter_group,
        all_reduce_group,
        reduce_dtype,
        device_type="",
        factor=None,
        force_sum_reduction_for_comms=False,
    ):
        if not force_sum_reduction_for_comms and (
            _is_gloo(reduce_scatter_group, device_type)
            or _is_gloo(all_reduce_group, device_type)
        ):
            force_sum_reduction_for_comms = True
        return original(
            reduce_scatter_group,
            all_reduce_group,
            reduce_dtype,
            device_type,
            factor,
            force_sum_reduction_for_comms,
        )

    coll._get_gradient_divide_factors = mark(_get_gradient_divide_factors, original)
    return True


def is_applied() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    return is_marked(coll._get_gradient_divide_factors)
