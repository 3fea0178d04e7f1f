"""cpu_device: resolve torchtitan's device type to "cpu" when there is no accelerator.

What it fixes
    ``torchtitan.tools.utils.get_device_info()`` does
    ``device_type = _get_available_device_type() or "cuda"``, so on a machine
    without any accelerator torchtitan still picks ``device_type="cuda"`` and
    ``device_module=torch.cuda``. The first use, ``Trainer.__init__`` ->
    ``device_module.set_device(...)``, then dies with (measured with the CPU
    build of torch 2.13)::

        AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'

    Past that point the process-group backend would be NCCL, the model would be
    materialized on ``cuda`` and the device mesh would be a CUDA mesh.

What it does
    When no accelerator is available, rebinds ``device_type = "cpu"`` and
    ``device_module = torch.cpu`` in ``torchtitan.tools.utils`` *and* in every
    already-imported ``torchtitan.*`` module that copied them with
    ``from torchtitan.tools.utils import device_type, device_module``
    (metrics, distributed.utils, distributed.parallel_dims, tools.profiler,
    models.common.token_dispatcher, ...). ``get_device_info`` is wrapped so later
    callers get the same answer. With ``device_type == "cpu"`` torchtitan's own
    backend map picks gloo (``Backend.default_device_backend_map["cpu"]``), the
    mesh is a CPU mesh and the model is initialized on CPU.

    ``get_local_device()`` then returns ``torch.device("cpu", 0)``
    (``torch.cpu.device_count() == 1``). That is left alone on purpose: a
    2-rank FSDP2 run, DCP save and resume were measured to behave identically
    with ``cpu:0`` and with ``cpu``.

Scope
    CPU-only. It is a no-op whenever ``torch._utils._get_available_device_type()``
    returns an accelerator (CUDA, ROCm, XPU, ...), so CUDA/NCCL runs are untouched.
    Import order: modules imported *after* the patch read the patched values from
    ``torchtitan.tools.utils`` themselves; modules imported *before* are swept.

Upstream status
    Unfixed upstream as of torchtitan 0.3.0 (the ``or "cuda"`` fallback is
    deliberate: torchtitan does not support CPU training).
"""

from __future__ import annotations

import functools
import sys

import torch

from ._util import PatchTargetChanged, is_marked, mark, require_attr, require_params

NAME = "cpu_device"


def _no_accelerator() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


def apply() -> bool:
    """Apply the patch. Returns True if it changed anything (now or before)."""
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tu

    old_type = require_attr(tu, "device_type")
    old_module = require_attr(tu, "device_module")
    get_device_info = require_attr(tu, "get_device_info")
    require_attr(tu, "get_local_device")  # reads the patched module globals
    require_attr(dist_utils, "device_type")  # picks the PG backend from it
    require_params(get_device_info, [], "torchtitan.tools.utils.get_device_info")

    if is_marked(get_device_info):
        return True  # already applied
    if not _no_accelerator():
        return False  # accelerator present: leave torchtitan's choice alone
    if old_type != "cuda" or old_module is not torch.cuda:
        # torchtitan no longer falls back to CUDA (fixed upstream?) -- nothing to do.
        return False

    new_type, new_module = "cpu", torch.cpu

    @functools.wraps(get_device_info)
    def patched_get_device_info():
        if _no_accelerator():
            return new_type, new_module
        return get_device_info()

    # Sweep every already-imported torchtitan module that copied the names.
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (
            mod_name == "torchtitan" or mod_name.startswith("torchtitan.")
        ):
            continue
        d = getattr(mod, "__dict__", {})
        if d.get("device_module") is old_module:
            d["device_module"] = new_module
        if d.get("device_type") == old_type and isinstance(d.get("device_type"), str):
            d["device_type"] = new_type

    tu.get_device_info = mark(patched_get_device_info, get_device_info)
    # distributed.utils copied both names (it picks the process-group backend
    # from device_type); the sweep rebinds them -- assert so a future refactor
    # cannot silently leave NCCL selected.
    for mod in (tu, dist_utils):
        if mod.device_type != "cpu" or mod.device_module is not torch.cpu:
            raise PatchTargetChanged(
                f"gefen_titan.patches.cpu_device: {mod.__name__}.device_type/"
                "device_module were not rebound to cpu; upstream changed."
            )
    return True


def is_applied() -> bool:
    import torchtitan.tools.utils as tu

    return is_marked(tu.get_device_info)
