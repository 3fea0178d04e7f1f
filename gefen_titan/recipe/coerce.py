"""The generic engine: a TOML table checked into a dataclass instance.

Recipes override torchtitan's config section by section with torchtitan's
own field names. Nothing here knows a section: ``coerce_value`` walks the
dataclass instances the base config function built (which may be
subclasses of the declared field types, e.g. a ``HuggingFaceTextDataLoader.Config``
where ``BaseDataLoader.Config`` is declared) and checks every key and value
against that instance's type hints, updating dataclasses in place so the
base config's other fields survive. Unions that torchtitan names as tyro
subcommands (``activation_checkpoint``: selective | full | memory-budget |
none) are picked with ``mode = "<name>"``. Every problem is a
``RecipeError`` naming the file and the key; a dataclass's ``__post_init__``
runs after its table, and what it refuses is one too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from gefen_titan.recipe.errors import RecipeError

__all__ = ["coerce_value", "type_hints"]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def type_hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, ``Annotated`` metadata kept (tyro's subcommand
    names live there); the raw annotations where a forward reference does not
    resolve."""
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # unresolvable forward refs: fall back to raw annotations
        hints: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            hints.update(getattr(klass, "__annotations__", {}))
        return hints


def coerce_value(value: Any, tp: Any, where: str, current: Any = None) -> Any:
    """Check ``value`` from TOML against type hint ``tp``; return the value to set.

    A TOML table applied to a dataclass-valued field updates that dataclass
    (``current``) in place of replacing it, so unknown keys are caught and
    the base config's other fields survive. Each kind of hint has its own
    coercer below; this picks one.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Annotated:
        return coerce_value(value, args[0], where, current)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, args, where, current)
    if origin is typing.Literal:
        if value not in args:
            raise RecipeError(f"{where.rstrip()}: must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp) or dataclasses.is_dataclass(current):
        return _coerce_dataclass(value, tp, where, current)
    if tp in _SCALARS:
        return _coerce_scalar(value, tp, where)
    if origin in (list, tuple) or tp in (list, tuple):
        return _coerce_array(value, tp, origin, args, where)
    if origin is dict or tp is dict:
        return dict(_table(value, where))
    raise RecipeError(f"{where.rstrip()}: fields of type {_type_name(tp)} cannot be set from a recipe")


def _table(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise RecipeError(f"{where.rstrip()}: expected a table, got {value!r}")
    return value


def _coerce_union(value: Any, tp: Any, args: tuple[Any, ...], where: str, current: Any) -> Any:
    """A tyro subcommand union picked by ``mode``; ``"none"`` for an optional field; else the first
    member that takes the value (``X | None``: X's own error says what the value should be)."""
    policies = _policies(args)
    if policies and isinstance(value, dict):
        return _coerce_policy(value, policies, where, current)
    members = [a for a in args if a is not type(None)]
    if isinstance(value, str) and value.lower() == "none" and len(members) < len(args):
        return None
    if len(members) == 1:
        return coerce_value(value, members[0], where, current)
    for member in members:
        try:
            return coerce_value(value, member, where, current)
        except RecipeError:
            continue
    raise RecipeError(f"{where.rstrip()}: expected {_type_name(tp)}, got {value!r}")


def _coerce_dataclass(value: Any, tp: Any, where: str, current: Any) -> Any:
    """A table into the dataclass already there (``current``), or a new one of ``tp``."""
    _table(value, where)
    target = current if dataclasses.is_dataclass(current) else None
    if target is None:
        try:
            target = tp()
        except TypeError:
            return _build_dataclass(tp, value, where)
    _apply_table(target, value, where)
    return target


# type -> (does a TOML value fit it, what the error says it expected, the value to set). bool is
# an int in Python: an integer or a number field refuses true/false.
_SCALARS: dict[type, tuple[Any, str, Any]] = {
    bool: (lambda v: isinstance(v, bool), "a boolean", lambda v: v),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", lambda v: v),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number", float),
    str: (lambda v: isinstance(v, str), "a string", lambda v: v),
}


def _coerce_scalar(value: Any, tp: type, where: str) -> Any:
    fits, expected, convert = _SCALARS[tp]
    if not fits(value):
        raise RecipeError(f"{where.rstrip()}: expected {expected}, got {value!r}")
    return convert(value)


def _coerce_array(value: Any, tp: Any, origin: Any, args: tuple[Any, ...], where: str) -> Any:
    """A list, a tuple of fixed items, or a tuple of one type; a comma-separated string for a
    ``list[str]`` (torchtitan's CLI convention)."""
    if isinstance(value, str) and origin is list and args == (str,):
        value = value.split(",")
    if not isinstance(value, list):
        raise RecipeError(f"{where.rstrip()}: expected an array, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise RecipeError(f"{where.rstrip()}: expected an array of {len(args)} items, got {value!r}")
        return tuple(coerce_value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    item_tp = args[0] if args else Any
    items = [coerce_value(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if (origin is tuple or tp is tuple) else items


def _policies(args: tuple[Any, ...]) -> dict[str, Any]:
    """Union members that torchtitan names as tyro subcommands, by name.

    E.g. ``activation_checkpoint`` is SelectiveAC | FullAC | MemoryBudgetAC |
    None, named "selective", "full", "memory-budget", "none".
    """
    out = {}
    for arg in args:
        if typing.get_origin(arg) is typing.Annotated:
            inner, *meta = typing.get_args(arg)
            for m in meta:
                name = getattr(m, "name", None)
                if isinstance(name, str):
                    out[name.replace("-", "_")] = inner
    return out


def _coerce_policy(table: dict[str, Any], policies: dict[str, Any], where: str, current: Any) -> Any:
    """``mode = "<name>"`` picks the policy; the other keys are its fields."""
    table = dict(table)
    mode = table.pop("mode", None)
    if mode is None:
        if not dataclasses.is_dataclass(current):
            raise RecipeError(f"{where.rstrip()}: set mode (one of {', '.join(policies)})")
        _apply_table(current, table, where)
        return current
    mode = str(mode).replace("-", "_")
    if mode not in policies:
        raise RecipeError(f"{_child(where, 'mode')}: must be one of {list(policies)}, got {mode!r}")
    cls = policies[mode]
    if cls is type(None) or cls is None:
        if table:
            raise RecipeError(f"{where.rstrip()}: mode = \"{mode}\" takes no other keys, got {sorted(table)}")
        return None
    target = current if type(current) is cls else cls()
    _apply_table(target, table, where)
    return target


def _build_dataclass(tp: type, table: dict[str, Any], where: str) -> Any:
    """Construct a dataclass with required fields (e.g. ParamGroupConfig)."""
    hints = type_hints(tp)
    known = {f.name for f in dataclasses.fields(tp) if f.init}
    kwargs = {}
    for key, value in table.items():
        if key not in known:
            raise RecipeError(f"{_child(where, key)}: unknown key (known: {sorted(known)})")
        kwargs[key] = coerce_value(value, hints.get(key, Any), _child(where, key))
    try:
        return tp(**kwargs)
    except TypeError as e:
        raise RecipeError(f"{where.rstrip()}: {e}") from None


def _child(where: str, key: str) -> str:
    return f"{where}{key}" if where.endswith("] ") else f"{where}.{key}"


def _apply_table(target: Any, table: dict[str, Any], where: str) -> None:
    cls = type(target)
    hints = type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    for key, value in table.items():
        if key not in names:
            raise RecipeError(
                f"{_child(where, key)}: unknown key for {cls.__qualname__} "
                f"(known: {', '.join(sorted(names))})"
            )
        current = getattr(target, key)
        new = coerce_value(value, hints.get(key, Any), _child(where, key), current)
        if new is not current:
            setattr(target, key, new)
    post_init = getattr(target, "__post_init__", None)
    if post_init is not None:
        try:
            post_init()
        except (ValueError, AssertionError, TypeError) as e:
            raise RecipeError(f"{where.rstrip()}: {e}") from None
