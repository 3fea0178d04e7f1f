"""Model converters in recipes: the base config's kept, a recipe's own explicit.

torchtitan 0.3.0 applies model converters (LoRA, float8, mxfp8, nvfp4) inside
``<module>.model_registry(flavor, converters=[...])``: they rewrite the model
config tree, and the ``ModelSpec`` that comes back keeps no list of them. A
recipe's ``[model]`` table rebuilds the spec from the registry
(``build._rebuild_model_spec``), so the converters the base config function
passed were lost without a word (issue 47: a LoRA base trained every weight).

``call_base_config`` therefore calls the base function with its module's
``model_registry`` recorded, and returns the converters the base config's
spec was built with, for the rebuild to pass again. A recipe replaces them
only by saying so, with ``[[model.converters]]`` tables (``kind`` and that
converter's torchtitan ``Config`` fields; ``converters = []`` drops them):
``converters_from_recipe``. A base whose spec was built where the recording
cannot see (not through its ``config_registry`` module's ``model_registry``)
and whose model is converted is refused rather than guessed at
(``check_unrecorded``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from gefen_titan.recipe.coerce import coerce_value
from gefen_titan.recipe.errors import RecipeError

__all__ = ["CONVERTERS", "call_base_config", "check_unrecorded", "converters_from_recipe"]

# kind in [[model.converters]] -> (torchtitan module, converter class). Imported
# when named: torchtitan.components.quantization imports torch._inductor.
CONVERTERS = {
    "lora": ("torchtitan.components.lora", "LoRAConverter"),
    "float8": ("torchtitan.components.quantization", "Float8LinearConverter"),
    "mxfp8": ("torchtitan.components.quantization", "MXFP8LinearConverter"),
    "nvfp4": ("torchtitan.components.quantization", "NVFP4LinearConverter"),
}


def _converter_class(kind: str) -> type:
    module, name = CONVERTERS[kind]
    return getattr(importlib.import_module(module), name)


def call_base_config(registry: Any, fn: Callable[[], Any]) -> tuple[Any, list[Any] | None]:
    """``fn()`` (a function of ``registry``, a ``torchtitan.models.<m>.config_registry``
    module) and the converters its ``model_spec`` was built with: ``[]`` for none,
    None when the spec was not built by a ``model_registry`` call seen here.

    The base functions call ``model_registry`` by their module's global name
    (``from . import model_registry``), and some call it twice (a float8
    variant calls the plain function first), so the call whose result is the
    final ``model_spec`` is the one that counts. The global is restored
    whatever ``fn`` raises.
    """
    original = getattr(registry, "model_registry", None)
    if original is None:
        return fn(), None
    signature = inspect.signature(original)
    built: list[tuple[Any, list[Any]]] = []  # holds the specs, so no id is reused meanwhile

    def recording(*args: Any, **kwargs: Any) -> Any:
        spec = original(*args, **kwargs)
        converters = signature.bind(*args, **kwargs).arguments.get("converters")
        built.append((spec, list(converters or [])))
        return spec

    registry.model_registry = recording
    try:
        config = fn()
    finally:
        registry.model_registry = original
    spec = getattr(config, "model_spec", None)
    return config, next((c for s, c in reversed(built) if s is spec), None)


def check_unrecorded(config: Any, registry_fn: Callable[..., Any], where: str) -> None:
    """Refuse to rebuild a base model whose converters were not recorded but
    which differs in module types from a plain ``registry_fn(flavor)`` build of
    its flavor (converted: a rebuild would drop what converted it)."""
    from torchtitan.protocols.module import Module  # noqa: PLC0415 (torchtitan's model code: seconds)

    spec = config.model_spec

    def types(model: Any) -> set[type]:
        return {type(c) for _, c, _, _ in model.traverse(Module.Config, recurse=True)}

    try:
        extra = types(spec.model) - types(registry_fn(spec.flavor).model)
    except Exception:
        return
    if extra:
        names = ", ".join(sorted(t.__qualname__ for t in extra)[:3])
        raise RecipeError(
            f"{where}: the base config's model is converted ({names}) by converters this recipe cannot see; "
            "[model] would rebuild it without them. Name them in [[model.converters]] tables, or set "
            "converters = [] to train the plain model")


def converters_from_recipe(value: Any, where: str) -> list[Any]:
    """``[[model.converters]]``: each table's ``kind`` (``CONVERTERS``) and the
    fields of that converter's torchtitan ``Config``, in order (torchtitan
    applies them in order and wants quantization before LoRA)."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RecipeError(f"{where}: expected [[model.converters]] tables (or converters = []), got {value!r}")
    out = []
    for i, table in enumerate(value):
        here = f"{where}[{i}]"
        table = dict(table)
        kind = table.pop("kind", None)
        if kind not in CONVERTERS:
            raise RecipeError(f"{here} kind: expected one of {', '.join(CONVERTERS)}, got {kind!r}")
        cls = _converter_class(kind).Config
        out.append(coerce_value(table, cls, f"{here} ", cls()))
    return out
