"""gloo_barrier: make ``set_pg_timeouts``' barrier work on gloo/CPU.

What it fixes
    ``torchtitan.distributed.utils.set_pg_timeouts`` (called by ``Trainer.train``
    after the first step) synchronizes with
    ``torch.distributed.barrier(device_ids=[device_module.current_device()])``.
    ``device_ids`` is meant for NCCL (GPU indices). On CPU, ``torch.cpu.current_device()``
    returns the *string* ``"cpu"``, so the call fails at the end of step 1 with::

        TypeError: (): incompatible function arguments. The following argument types are supported:
            1. (self: torch._C._distributed_c10d.BarrierOptions,
                arg0: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None
        Invoked with: <torch.distributed.distributed_c10d.BarrierOptions object at 0x...>, ['cpu']

What it does
    Replaces ``set_pg_timeouts`` with a version that, when torchtitan's device type
    is "cpu", does the same work without ``device_ids``: a plain
    ``barrier()``, then ``torch.distributed.set_timeout(timeout, group)`` for every
    one-dimensional mesh group and the default group (see ``dist_set_timeout``);
    ``torch.cpu.synchronize()`` is a no-op and is skipped. On any other device
    type it calls the original function unchanged.

Scope
    CPU/gloo only; CUDA/NCCL runs execute the upstream function.

Upstream status
    Unfixed upstream as of torchtitan 0.3.0.
"""

from __future__ import annotations

import functools

from ._util import is_marked, mark, require_attr, require_params

NAME = "gloo_barrier"


def apply() -> bool:
    import torchtitan.distributed.utils as dist_utils

    original = require_attr(dist_utils, "set_pg_timeouts")
    if is_marked(original):
        return True
    require_params(original, ["timeout", "parallel_dims"], "torchtitan.distributed.utils.set_pg_timeouts")

    @functools.wraps(original)
    def set_pg_timeouts(timeout, parallel_dims):
        import torch
        import torchtitan.tools.utils as tu

        if tu.device_type != "cpu":
            return original(timeout, parallel_dims)
        dist_utils.logger.info(
            f"Synchronizing and adjusting timeout for all ProcessGroups to {timeout}"
        )
        torch.distributed.barrier()  # no device_ids: that argument is NCCL-only
        groups = [
            mesh.get_group()
            for mesh in parallel_dims.get_all_one_dimensional_meshes().values()
        ] + [None]
        for group in groups:
            torch.distributed.set_timeout(timeout, group)

    dist_utils.set_pg_timeouts = mark(set_pg_timeouts, original)
    return True


def is_applied() -> bool:
    import torchtitan.distributed.utils as dist_utils

    return is_marked(dist_utils.set_pg_timeouts)
