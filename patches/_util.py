"""Small helpers shared by the patch modules (no torchtitan imports here)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

# Attribute set on every replacement function so a patch can tell its own
# wrapper from the upstream original (idempotence, and tests).
PATCH_MARKER = "__gefen_titan_patch__"


class PatchTargetChanged(RuntimeError):
    """The upstream object a patch replaces no longer looks as expected."""


def require_attr(owner: Any, name: str) -> Any:
    if not hasattr(owner, name):
        raise PatchTargetChanged(
            f"gefen_titan.patches: expected {_owner_name(owner)}.{name} to exist; "
            "the installed torch/torchtitan differs from the version this patch "
            "was written for. Re-verify the patch before using it."
        )
    return getattr(owner, name)


def require_params(fn: Callable, expected: Sequence[str], what: str) -> None:
    """Fail loudly unless ``fn``'s parameter names start with ``expected``."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:  # builtins without signatures
        raise PatchTargetChanged(f"gefen_titan.patches: cannot inspect {what}: {e}") from e
    if params[: len(expected)] != list(expected):
        raise PatchTargetChanged(
            f"gefen_titan.patches: {what} has parameters {params}, expected them "
            f"to start with {list(expected)}. The upstream code changed; "
            "re-verify the patch."
        )


def mark(fn: Callable, original: Callable | None = None) -> Callable:
    setattr(fn, PATCH_MARKER, True)
    if original is not None:
        fn.__wrapped_original__ = original  # type: ignore[attr-defined]
    return fn


def is_marked(fn: Any) -> bool:
    return bool(getattr(fn, PATCH_MARKER, False))


def _owner_name(owner: Any) -> str:
    return getattr(owner, "__name__", None) or type(owner).__name__
