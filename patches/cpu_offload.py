"""cpu_offload: let ``--training.enable_cpu_offload`` train on CPU hosts.

What it fixes
    ``training.enable_cpu_offload`` keeps FSDP2's sharded parameters, gradients
    and the optimizer state in host memory (``CPUOffloadPolicy``) and runs the
    optimizer step on the host. On a CPU host two things stop it (measured, 2
    gloo ranks, ``recipes/llama_gefen.toml``):

    1. torchtitan's ``init_distributed`` asks for
       ``f"{device_type}:{backend},cpu:gloo"``, which names CPU twice there::

           ValueError: Duplicate device type cpu in backend string: cpu:gloo,cpu:gloo

    2. torchtitan builds ``CPUOffloadPolicy()``, whose ``pin_memory=True`` makes
       FSDP2 pin the shards, which needs an accelerator::

           RuntimeError: Cannot access accelerator device when none is available.

What it does
    On a CPU host (torchtitan's device type "cpu"): ``init_distributed`` drops
    ``enable_cpu_backend`` (gloo already serves CPU tensors, so the backend is
    plain "gloo"), and ``torchtitan.distributed.fsdp`` (the FSDP2 set-up of
    llama3, qwen3, deepseek_v3, gpt_oss, ...) builds ``CPUOffloadPolicy(pin_memory
    =False)`` (pinned memory only speeds up host-device copies, which a CPU host
    does not make). On any other device type both call upstream unchanged.

Scope
    CPU hosts with ``enable_cpu_offload`` only; CUDA runs take the upstream path.

Upstream status
    Unfixed upstream as of torchtitan 0.3.0 (CPU offload is a GPU feature there).
"""

from __future__ import annotations

import functools

from ._util import PatchTargetChanged, is_marked, mark, require_attr, require_params

NAME = "cpu_offload"


def _on_cpu() -> bool:
    import torchtitan.tools.utils as tu

    return tu.device_type == "cpu"


def apply() -> bool:
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.fsdp import CPUOffloadPolicy

    original = require_attr(dist_utils, "init_distributed")
    policy = require_attr(tt_fsdp, "CPUOffloadPolicy")
    if is_marked(original):
        return True
    require_params(original, ["comm_config", "enable_cpu_backend"], "torchtitan.distributed.utils.init_distributed")
    if policy is not CPUOffloadPolicy:
        raise PatchTargetChanged("gefen_titan.patches: torchtitan.distributed.fsdp.CPUOffloadPolicy is not torch's "
                                 "CPUOffloadPolicy; re-verify the cpu_offload patch")

    @functools.wraps(original)
    def init_distributed(comm_config, enable_cpu_backend=False, *args, **kwargs):
        if _on_cpu():
            enable_cpu_backend = False  # "cpu:gloo,cpu:gloo" otherwise: gloo already serves CPU tensors
        return original(comm_config, enable_cpu_backend, *args, **kwargs)

    @functools.wraps(CPUOffloadPolicy)
    def cpu_offload_policy(*args, **kwargs):
        if _on_cpu():
            kwargs.setdefault("pin_memory", False)  # pinning needs an accelerator
        return CPUOffloadPolicy(*args, **kwargs)

    dist_utils.init_distributed = mark(init_distributed, original)
    tt_fsdp.CPUOffloadPolicy = mark(cpu_offload_policy, CPUOffloadPolicy)
    return True


def is_applied() -> bool:
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as dist_utils

    return is_marked(dist_utils.init_distributed) and is_marked(tt_fsdp.CPUOffloadPolicy)
