"""Runtime patches that let torchtitan 0.3.0 train on CPU ranks with gloo + FSDP2.

Call :func:`apply_all` once, before building the torchtitan ``Trainer`` (it may
be called again; it is idempotent). Every patch is written to be a no-op or
harmless on CUDA/NCCL, so the same code path runs unchanged on GPUs.

The patches are pinned to exact upstream versions: :func:`apply_all` refuses to
run (``RuntimeError``) on any other torchtitan release or torch major.minor,
rather than silently mis-patching. See ``README.md`` next to this file for the
list of patches and the config-only settings a CPU recipe needs.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Iterable
from types import ModuleType

from . import (
    cpu_device,
    cpu_dtensor_rng,
    cpu_memory_monitor,
    cpu_offload,
    dist_set_timeout,
    gloo_barrier,
    gloo_reduce_op,
    pp_presplit_step,
    pp_split_backward_unshard,
)
from ._util import PatchTargetChanged

__all__ = [
    "EXPECTED_TORCH",
    "EXPECTED_TORCHTITAN",
    "PATCHES",
    "PatchTargetChanged",
    "applied",
    "apply_all",
    "check_versions",
]

EXPECTED_TORCHTITAN = "0.3.0"
EXPECTED_TORCH = (2, 13)  # major, minor

# Order matters: cpu_device must run first, the others read the device type.
PATCHES: tuple[ModuleType, ...] = (
    cpu_device,
    cpu_offload,
    cpu_dtensor_rng,
    cpu_memory_monitor,
    dist_set_timeout,
    gloo_barrier,
    gloo_reduce_op,
    pp_presplit_step,
    pp_split_backward_unshard,
)

_lock = threading.Lock()
# patch name -> True (installed) / False (not needed here, e.g. on CUDA)
_results: dict[str, bool] = {}


def _torchtitan_version() -> str:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        import torchtitan

        return str(getattr(torchtitan, "__version__", "unknown"))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


def check_versions() -> None:
    """Raise ``RuntimeError`` unless torchtitan == 0.3.0 and torch is 2.13.x."""
    tt, th = _torchtitan_version(), _torch_version()
    problems = []
    if tt != EXPECTED_TORCHTITAN:
        problems.append(f"torchtitan {tt} (expected {EXPECTED_TORCHTITAN})")
    if _major_minor(th) != EXPECTED_TORCH:
        problems.append(
            f"torch {th} (expected {EXPECTED_TORCH[0]}.{EXPECTED_TORCH[1]}.x)"
        )
    if problems:
        raise RuntimeError(
            "gefen_titan.patches were written and verified for torchtitan "
            f"{EXPECTED_TORCHTITAN} with torch {EXPECTED_TORCH[0]}.{EXPECTED_TORCH[1]}, "
            f"but found {' and '.join(problems)}. Refusing to monkeypatch a "
            "different version; re-verify every patch in patches/ (shipped as gefen_titan.patches) "
            "(see its README.md) and update the pins."
        )


def apply_all(exclude: Iterable[str] = ()) -> dict[str, bool]:
    """Apply every patch (idempotent). Returns ``{name: active}``: True if the
    patch is installed, False if this environment does not need it (e.g.
    ``cpu_device`` on a CUDA machine).

    ``exclude`` names patches to leave out; it is meant for tests and for
    measuring which patches are needed, not for recipes.
    """
    excluded = set(exclude)
    unknown = excluded - {p.NAME for p in PATCHES}
    if unknown:
        raise ValueError(f"unknown patch names in exclude: {sorted(unknown)}")
    check_versions()
    with _lock:
        for patch in PATCHES:
            if patch.NAME in excluded or patch.NAME in _results:
                continue
            _results[patch.NAME] = bool(patch.apply())
        return dict(_results)


def applied() -> dict[str, bool]:
    """The patches applied so far in this process (``{name: active}``)."""
    return dict(_results)
