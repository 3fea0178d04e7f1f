"""dist_set_timeout: provide ``torch.distributed.set_timeout`` on torch 2.13.

What it fixes
    After the first training step ``Trainer.train`` calls
    ``torchtitan.distributed.utils.set_pg_timeouts``, which ends with
    ``torch.distributed.set_timeout(timeout, group)`` for every mesh group. torch
    2.13 has no such public function (only the private
    ``torch.distributed.distributed_c10d._set_pg_timeout(timeout, group=None)``),
    so every torchtitan 0.3.0 run crashes at the end of step 1 with::

        AttributeError: module 'torch.distributed' has no attribute 'set_timeout'

What it does
    If (and only if) ``torch.distributed.set_timeout`` is missing, binds it to
    ``torch.distributed.distributed_c10d._set_pg_timeout`` (same
    ``(timeout, group=None)`` contract; it sets the default timeout of the gloo
    and/or NCCL backends of ``group``).

Scope
    All backends (CUDA/NCCL runs hit the same AttributeError). If a torch build
    already provides ``set_timeout`` the patch does nothing.

Upstream status
    Unfixed as of torchtitan 0.3.0 + torch 2.13: torchtitan calls an API that
    this torch release does not export. torch 2.14 exports
    ``torch.distributed.set_timeout(timeout, group=None)`` (verified on 2.14.1:
    ``UPSTREAM_FROM_TORCH``), so there the patch does nothing. Drop it when 2.13
    leaves ``SUPPORTED_TORCH``.
"""

from __future__ import annotations

from ._util import is_marked, mark, require_attr, require_params

NAME = "dist_set_timeout"


def apply() -> bool:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torchtitan.distributed.utils as dist_utils

    # The caller we are satisfying must still be there and still call it.
    require_attr(dist_utils, "set_pg_timeouts")
    existing = getattr(dist, "set_timeout", None)
    if existing is not None:
        return is_marked(existing)  # True if we installed it earlier
    impl = require_attr(c10d, "_set_pg_timeout")
    require_params(impl, ["timeout", "group"], "torch.distributed.distributed_c10d._set_pg_timeout")

    def set_timeout(timeout, group=None):
        """Set the default timeout of ``group`` (default: world). Alias installed by
        gefen_titan.patches.dist_set_timeout for
        ``torch.distributed.distributed_c10d._set_pg_timeout``."""
        return c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = mark(set_timeout, impl)
    return True


def is_applied() -> bool:
    import torch.distributed as dist

    return is_marked(getattr(dist, "set_timeout", None))
