"""Runtime patches that let torchtitan 0.3.0 train on CPU ranks with gloo + FSDP2.

Call :func:`apply_all` once, before building the torchtitan ``Trainer`` (it may
be called again; it is idempotent). Every patch is written to be a no-op or
harmless on CUDA/NCCL, so the same code path runs unchanged on GPUs.

The patches are pinned to exact upstream versions: :func:`apply_all` refuses to
run (``RuntimeError``) on any other torchtitan release or on a torch major.minor
outside :data:`SUPPORTED_TORCH` (each one verified), rather than silently
mis-patching; the message names the pip command that installs a supported one.
pyproject's ``torch`` range is :data:`TORCH_REQUIREMENT` (a unit test holds them
equal). See ``README.md`` next to this file for the list of patches, how each
torch version was verified, and the config-only settings a CPU recipe needs.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Iterable
from types import ModuleType

from gefen_titan.errors import UserError

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
    "EXPECTED_TORCHTITAN",
    "PATCHES",
    "SUPPORTED_TORCH",
    "UnverifiedVersions",
    "TORCH_REQUIREMENT",
    "UPSTREAM_FROM_TORCH",
    "PatchTargetChanged",
    "applied",
    "apply_all",
    "check_versions",
    "needed_on",
]

EXPECTED_TORCHTITAN = "0.3.0"
# The torch releases (major, minor) every patch and contract test was run on,
# each one verified as patches/README.md "Torch versions" says. Consecutive,
# so that pyproject can state them as one range: TORCH_REQUIREMENT.
SUPPORTED_TORCH: tuple[tuple[int, int], ...] = ((2, 13), (2, 14))


def _requirement(supported: tuple[tuple[int, int], ...]) -> str:
    """``torch>=first,<next-after-last`` for consecutive minors of one major."""
    (major, first), (_, last) = supported[0], supported[-1]
    if list(supported) != [(major, m) for m in range(first, last + 1)]:
        raise ValueError(f"SUPPORTED_TORCH must be consecutive minors of one major, in order: {supported}")
    return f"torch>={major}.{first},<{major}.{last + 1}"


# pyproject.toml's [project] dependency on torch, exactly (tests/unit/test_torch_versions.py).
TORCH_REQUIREMENT = _requirement(SUPPORTED_TORCH)

# Patches whose fix torch itself ships from a given release on: there the patch
# finds the upstream API, installs nothing and reports False. Per supported
# release, tests/unit/test_patches.py asserts exactly this split (installed below
# the release, upstream's from it on), so a torch that moves either way fails it.
UPSTREAM_FROM_TORCH: dict[str, tuple[int, int]] = {
    "dist_set_timeout": (2, 14),  # torch.distributed.set_timeout(timeout, group) is public in 2.14
    "pp_presplit_step": (2, 14),  # step(arg_mbs=, kwarg_mbs=, target_mbs=) in 2.14 (pytorch/pytorch PR #188500)
}

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


def needed_on(torch_version: str) -> set[str]:
    """The patches a CPU run needs on this torch: all but those whose fix the
    release ships (:data:`UPSTREAM_FROM_TORCH`)."""
    mm = _major_minor(torch_version)
    return {p.NAME for p in PATCHES if mm < UPSTREAM_FROM_TORCH.get(p.NAME, (999, 0))}


def _supported_torch_text() -> str:
    return " or ".join(f"{a}.{b}.x" for a, b in SUPPORTED_TORCH)


class UnverifiedVersions(UserError, RuntimeError):
    """torch or torchtitan at a version the patches were not verified for (the message names the pip fix)."""


def check_versions() -> None:
    """Raise ``RuntimeError`` unless torchtitan == 0.3.0 and torch's major.minor
    is in :data:`SUPPORTED_TORCH`; the message names the pip command that fixes it."""
    tt, th = _torchtitan_version(), _torch_version()
    problems, fixes = [], []
    if tt != EXPECTED_TORCHTITAN:
        problems.append(f"torchtitan {tt} (expected {EXPECTED_TORCHTITAN})")
        fixes.append(f"torchtitan=={EXPECTED_TORCHTITAN}")
    if _major_minor(th) not in SUPPORTED_TORCH:
        problems.append(f"torch {th} (expected {_supported_torch_text()})")
        fixes.append(_requirement(SUPPORTED_TORCH))
    if problems:
        pip = "pip install " + " ".join(f"'{f}'" for f in fixes)
        raise UnverifiedVersions(
            f"gefen_titan.patches were verified for torchtitan {EXPECTED_TORCHTITAN} with torch "
            f"{_supported_torch_text()}, but found {' and '.join(problems)}. Install a verified version: "
            f"`{pip}` (on GPUs, the CUDA build of that torch for your driver; pyproject's range is the same). "
            "Refusing to monkeypatch a different version: supporting another one means re-verifying "
            "every patch in gefen_titan.patches (patches/README.md, 'Torch versions')."
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
