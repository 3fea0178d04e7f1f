"""TOML recipes on top of torchtitan 0.3.0's Python configs.

torchtitan 0.3.0 describes a run with a Python function returning a
``Trainer.Config`` (``--module llama3 --config llama3_debugmodel``) plus tyro
CLI flags; it dropped TOML. A recipe here names such a base function and
overrides its fields section by section, with torchtitan's own names::

    [job]
    module = "llama3"                    # torchtitan.models.<module>
    base_config = "llama3_debugmodel"    # function in its config_registry
    dump_folder = "./outputs"            # top-level Trainer.Config fields
    hf_assets_path = "..."               #   live in [job]

    [model]                              # rebuilt with <module>.model_registry
    flavor = "debugmodel"
    attn_backend = "sdpa"

    [optimizer]                          # GefenOptimizersContainer.Config
    name = "Gefen"                       # with [[optimizer.param_groups]]:
    lr = 3e-3                            #   the defaults of every group

    [training]                           # any Trainer.Config section, its
    steps = 20                           # fields by their dataclass names

    [dataloader]                         # loader picks the class: "elastic"
    loader = "global_order"              # (default) or "global_order"; the
                                         # other keys are its fields

The loader is generic: it walks the dataclass instances the base function
built (which may be subclasses of the declared field types, e.g. a
``HuggingFaceTextDataLoader.Config`` where ``BaseDataLoader.Config`` is
declared) and checks every key and value against that instance's type hints.
Every problem is a ``RecipeError`` naming the file and the key, raised before
any process group exists, so all ranks fail the same way; that includes a key
that would have no effect (``finish_recipe``). ``load_recipe`` is
``build_recipe`` then ``finish_recipe``; ``gefen_titan.recipe.cli`` parses
torchtitan's command line over the built config in between.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import types
import typing
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from torchtitan.components.checkpoint import CheckpointManager

from gefen_titan.data.global_loader import GlobalOrderDataLoader
from gefen_titan.data.registry import UnknownLoaderError, lift_dataloader_config, loader_config_class
from gefen_titan.optim.container import GROUP_DEFAULTS, GefenOptimizersContainer

__all__ = ["RecipeError", "Recipe", "build_recipe", "declared_world_size", "finish_recipe", "load_recipe", "validate_mesh"]

JOB_KEYS = ("module", "base_config", "extends", "description", "dump_folder", "hf_assets_path")
MODEL_KEYS = ("flavor", "attn_backend")
# Top-level Trainer.Config scalars that recipes set from [job].
_TOP_LEVEL_FROM_JOB = ("dump_folder", "hf_assets_path")


# ``hf_assets_path = "builtin://tokenizer"`` names the tokenizer shipped in the
# package, wherever it is installed (recipes cannot know site-packages).
BUILTIN_PREFIX = "builtin://"


def _builtin_asset(value: str, where: str) -> str:
    from gefen_titan.data import corpus as data

    assets = {"tokenizer": data.DEFAULT_TOKENIZER_PATH}
    name = value[len(BUILTIN_PREFIX):]
    if name not in assets:
        raise RecipeError(f"{where}: unknown built-in asset {value!r} (known: {', '.join(BUILTIN_PREFIX + a for a in assets)})")
    return assets[name]


class RecipeError(ValueError):
    """A recipe (or an override of it) that cannot describe a valid run."""


@dataclasses.dataclass
class Recipe:
    """A parsed recipe: the torchtitan config plus what only the recipe knows."""

    path: str
    config: Any  # torchtitan.trainer.Trainer.Config
    module: str
    base_config: str
    flavor: str | None = None
    attn_backend: str | None = None
    description: str = ""
    set_by: dict[str, str] = dataclasses.field(default_factory=dict)
    """Where some values were set ("optimizer.lr" -> "x.toml: [optimizer] lr"),
    for the errors about them: the ``GROUP_DEFAULTS`` and hf_assets_path."""


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from None


def _read_recipe_data(path: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The recipe's tables, on top of those of the recipe it ``extends``.

    ``[job] extends = "llama_gefen.toml"`` (relative to this file) lets a
    variant state only what differs, e.g. its mesh.
    """
    data = _read_toml(path)
    job = data.get("job", {})
    parent = job.get("extends") if isinstance(job, dict) else None
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise RecipeError(f"{path}: [job] extends: expected a path string, got {parent!r}")
    parent_path = os.path.normpath(os.path.join(os.path.dirname(path), parent))
    if os.path.abspath(parent_path) in _seen + (os.path.abspath(path),):
        raise RecipeError(f"{path}: [job] extends: {parent!r} extends itself (cycle)")
    if not os.path.exists(parent_path):
        raise RecipeError(f"{path}: [job] extends: {parent_path} not found")
    base = _read_recipe_data(parent_path, _seen + (os.path.abspath(path),))
    base.get("job", {}).pop("extends", None)
    job.pop("extends")
    _merge(base, data, path)
    return base


def declared_world_size(path: str | os.PathLike, fill: int = 2) -> int:
    """Processes a recipe's mesh needs: the product of its declared degrees.

    ``data_parallel_shard_degree = -1`` (FSDP over whatever is left) counts as
    ``fill``; the other degrees default to 1.
    """
    par = _read_recipe_data(str(path)).get("parallelism", {})
    shard = int(par.get("data_parallel_shard_degree", -1))
    world = fill if shard < 0 else shard
    for key in ("data_parallel_replicate_degree", "context_parallel_degree", "tensor_parallel_degree",
                "pipeline_parallel_degree", "expert_parallel_degree"):
        if key != "expert_parallel_degree":  # EP borrows from the others, adds no ranks
            world *= max(1, int(par.get(key, 1)))
    return world


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # unresolvable forward refs: fall back to raw annotations
        hints: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            hints.update(getattr(klass, "__annotations__", {}))
        return hints


def _coerce(value: Any, tp: Any, where: str, current: Any = None) -> Any:
    """Check ``value`` from TOML against type hint ``tp``; return the value to set.

    A TOML table applied to a dataclass-valued field updates that dataclass
    (``current``) in place of replacing it, so unknown keys are caught and
    the base config's other fields survive.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Annotated:
        return _coerce(value, args[0], where, current)
    if origin in (typing.Union, types.UnionType):
        policies = _policies(args)
        if policies and isinstance(value, dict):
            return _coerce_policy(value, policies, where, current)
        members = [a for a in args if a is not type(None)]
        if isinstance(value, str) and value.lower() == "none" and len(members) < len(args):
            return None
        errors = []
        for member in members:
            try:
                return _coerce(value, member, where, current)
            except RecipeError as e:
                errors.append(str(e))
        raise RecipeError(f"{where.rstrip()}: expected {_type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise RecipeError(f"{where.rstrip()}: must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp) or dataclasses.is_dataclass(current):
        if not isinstance(value, dict):
            raise RecipeError(f"{where.rstrip()}: expected a table, got {value!r}")
        target = current if dataclasses.is_dataclass(current) else None
        if target is None:
            try:
                target = tp()
            except TypeError:
                return _build_dataclass(tp, value, where)
        _apply_table(target, value, where)
        return target
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{where.rstrip()}: expected a boolean, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{where.rstrip()}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{where.rstrip()}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{where.rstrip()}: expected a string, got {value!r}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str) and origin is list and args == (str,):
            value = value.split(",")  # torchtitan's CLI convention for list[str]
        if not isinstance(value, list):
            raise RecipeError(f"{where.rstrip()}: expected an array, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise RecipeError(
                    f"{where.rstrip()}: expected an array of {len(args)} items, got {value!r}"
                )
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where.rstrip()}: expected a table, got {value!r}")
        return dict(value)
    raise RecipeError(f"{where.rstrip()}: fields of type {_type_name(tp)} cannot be set from a recipe")


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
    hints = _hints(tp)
    known = {f.name for f in dataclasses.fields(tp) if f.init}
    kwargs = {}
    for key, value in table.items():
        if key not in known:
            raise RecipeError(f"{_child(where, key)}: unknown key (known: {sorted(known)})")
        kwargs[key] = _coerce(value, hints.get(key, Any), _child(where, key))
    try:
        return tp(**kwargs)
    except TypeError as e:
        raise RecipeError(f"{where.rstrip()}: {e}") from None


def _child(where: str, key: str) -> str:
    return f"{where}{key}" if where.endswith("] ") else f"{where}.{key}"


def _apply_table(target: Any, table: dict[str, Any], where: str) -> None:
    cls = type(target)
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    for key, value in table.items():
        if key not in names:
            raise RecipeError(
                f"{_child(where, key)}: unknown key for {cls.__qualname__} "
                f"(known: {', '.join(sorted(names))})"
            )
        current = getattr(target, key)
        new = _coerce(value, hints.get(key, Any), _child(where, key), current)
        if new is not current:
            setattr(target, key, new)
    post_init = getattr(target, "__post_init__", None)
    if post_init is not None:
        try:
            post_init()
        except (ValueError, AssertionError, TypeError) as e:
            raise RecipeError(f"{where.rstrip()}: {e}") from None


def _as_gefen_optimizer_config(opt: Any) -> GefenOptimizersContainer.Config:
    """Lift a base function's ``OptimizersContainer.Config`` into ours.

    A single catch-all group (what ``default_adamw`` builds) becomes the
    shorthand fields, so ``[optimizer] name = "Gefen"`` replaces it instead of
    being shadowed by it; several groups are kept as they are.
    """
    if isinstance(opt, GefenOptimizersContainer.Config):
        return opt
    new = GefenOptimizersContainer.Config(
        implementation=opt.implementation,
        optimizer_factory_kwargs_by_name=dict(opt.optimizer_factory_kwargs_by_name),
    )
    groups = list(opt.param_groups)
    if len(groups) == 1 and groups[0].pattern in (".*", r".*"):
        g = groups[0]
        kw = dict(g.optimizer_kwargs)
        new.name = g.optimizer_name
        new.lr = float(kw.pop("lr", new.lr))
        new.betas = tuple(kw.pop("betas", new.betas))
        new.eps = float(kw.pop("eps", new.eps))
        new.weight_decay = float(kw.pop("weight_decay", new.weight_decay))
        if kw:  # kwargs the shorthand has no field for: keep the group as is
            new.param_groups = groups
    else:
        new.param_groups = groups
    return new


def _as_gefen_checkpoint_config(ckpt: Any) -> Any:
    """Lift torchtitan's CheckpointManager.Config into ours (same fields), so
    checkpoint.enable = true routes Gefen state through the resharding loader."""
    from gefen_titan.checkpoint.manager import GefenCheckpointManager

    if isinstance(ckpt, GefenCheckpointManager.Config) or type(ckpt) is not CheckpointManager.Config:
        return ckpt
    values = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt) if f.init}
    return GefenCheckpointManager.Config(**values)


def _choose_dataloader(current: Any, kind: Any, where: str) -> Any:
    """``[dataloader] loader``: keep ``current`` if it is already of that kind,
    else a fresh config of the chosen class (its defaults, then the section's keys)."""
    try:
        cls = loader_config_class(kind)
    except UnknownLoaderError as e:
        raise RecipeError(f"{where}: {e}") from None
    return current if type(current) is cls else cls()


def _check_global_order_batch(config: Any, path: str, world_size: int | None) -> None:
    """A global-order recipe must fix the global batch, divisible at this DP size.

    The loader's batches are the same samples at every DP size only if a step
    is the same number of samples at every DP size (the trainer otherwise
    makes it local_batch_size x dp degree). torchtitan also asserts the
    divisibility, but only once the process group exists.
    """
    if not isinstance(config.dataloader, GlobalOrderDataLoader.Config):
        return
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    p, t = config.parallelism, config.training
    shard = p.data_parallel_shard_degree
    if shard == -1:
        others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree
        shard = world_size // others
    dp = p.data_parallel_replicate_degree * shard
    local, gbs = t.local_batch_size, t.global_batch_size
    if gbs <= 0:
        raise RecipeError(
            f"{path}: [training] global_batch_size: [dataloader] loader = \"global_order\" needs a fixed "
            "global batch (samples per optimizer step), so that a resume at another data-parallel size "
            f"reads the same batches; set it, e.g. global_batch_size = {local * dp} (local_batch_size "
            f"{local} x dp degree {dp}; a multiple of it for gradient accumulation)"
        )
    if gbs % (local * dp):
        fits = [b for b in range(1, gbs // dp + 1) if gbs % (b * dp) == 0] if gbs % dp == 0 else []
        hint = (f"local_batch_size values that fit: {', '.join(map(str, fits))}" if fits
                else f"no local_batch_size fits: make global_batch_size a multiple of {dp}")
        raise RecipeError(
            f"{path}: [training] global_batch_size {gbs} is not a multiple of local_batch_size {local} x "
            f"data-parallel degree {dp} = {local * dp}: the global batch cannot be cut into equal rank "
            f"slices at this size ({hint})"
        )


def _rebuild_model_spec(config: Any, module: str, flavor: str | None, attn_backend: str | None, where: str) -> None:
    """Rebuild ``model_spec`` from ``<module>.model_registry`` for [model]."""
    spec = config.model_spec
    flavor = flavor or (spec.flavor if spec is not None else None)
    if flavor is None:
        raise RecipeError(f"{where} flavor: the base config has no model; set a flavor")
    mod = importlib.import_module(f"torchtitan.models.{module}")
    if module == "llama3":
        from gefen_titan.recipe.flavors import register_flavors

        register_flavors()  # [model] flavor = "150M"
    registry = getattr(mod, "model_registry", None)
    if registry is None:
        raise RecipeError(f"{where}: torchtitan.models.{module} has no model_registry")
    kwargs = {}
    if attn_backend is not None:
        kwargs["attn_backend"] = attn_backend
    try:
        config.model_spec = registry(flavor, **kwargs)
    except KeyError:
        flavors = sorted(getattr(mod, f"{module}_configs", {}) or [])
        raise RecipeError(
            f"{where} flavor: unknown flavor {flavor!r} for {module}"
            + (f" (known: {', '.join(flavors)})" if flavors else "")
        ) from None
    except (ValueError, TypeError, AssertionError) as e:
        raise RecipeError(f"{where}: {e}") from None
    # The base function sized the loss for its own model.
    loss_fn = getattr(getattr(config, "loss", None), "loss_fn", None)
    if loss_fn is not None and hasattr(loss_fn, "global_vocab_size"):
        from torchtitan.models.common.config_utils import decoder_vocab_size

        loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)


def _base_config(module: str, base_config: str, path: str) -> Any:
    try:
        registry = importlib.import_module(f"torchtitan.models.{module}.config_registry")
    except ImportError as e:
        raise RecipeError(f"{path}: [job] module: cannot import torchtitan.models.{module} ({e})") from None
    fn = getattr(registry, base_config, None)
    if not callable(fn):
        known = [n for n in dir(registry) if not n.startswith("_") and n[0].islower() and callable(getattr(registry, n))]
        raise RecipeError(
            f"{path}: [job] base_config: {base_config!r} is not a config function "
            f"of torchtitan.models.{module} (known: {', '.join(sorted(known))})"
        )
    return fn()


def _own_section(data: dict[str, Any], name: str, known: tuple[str, ...], path: str) -> dict[str, Any]:
    """Pop one of the sections the recipe layer itself interprets ([job], [model])."""
    table = data.pop(name, {})
    if not isinstance(table, dict):
        raise RecipeError(f"{path}: {name} must be a [{name}] section")
    for key in table:
        if key not in known:
            raise RecipeError(f"{path}: [{name}] {key}: unknown key (known: {', '.join(known)})")
    return table


def load_recipe(path: str | os.PathLike, overrides: dict[str, dict[str, Any]] | None = None, *, world_size: int | None = None) -> Recipe:
    """Read a recipe, apply ``overrides`` (section -> key -> value) on top.

    ``world_size`` (default: ``$WORLD_SIZE`` or 1) is checked against the mesh.
    (``gefen_titan.recipe.cli.load_cli`` is the same with torchtitan's
    command line parsed over the recipe between the two steps.)
    """
    recipe = build_recipe(path, overrides)
    finish_recipe(recipe, world_size)
    return recipe


def build_recipe(path: str | os.PathLike, overrides: dict[str, dict[str, Any]] | None = None) -> Recipe:
    """The config a recipe describes, before the checks of ``finish_recipe``
    (which need the values the command line may still change)."""
    path = str(path)
    data = _read_recipe_data(path)
    _merge(data, overrides or {}, path)

    job = _own_section(data, "job", JOB_KEYS, path)
    module = job.get("module", "llama3")
    base_config = job.get("base_config")
    if not isinstance(module, str) or not isinstance(base_config, str):
        raise RecipeError(f"{path}: [job] needs module and base_config strings (e.g. base_config = \"llama3_debugmodel\")")
    config = _base_config(module, base_config, path)
    hints = _hints(type(config))
    for key in _TOP_LEVEL_FROM_JOB:
        if key in job:
            setattr(config, key, _coerce(job[key], hints[key], f"{path}: [job] {key}"))

    model = _own_section(data, "model", MODEL_KEYS, path)
    for key in model:
        if not isinstance(model[key], str):
            raise RecipeError(f"{path}: [model] {key}: expected a string, got {model[key]!r}")
    if model:
        _rebuild_model_spec(config, module, model.get("flavor"), model.get("attn_backend"), f"{path}: [model]")

    config.optimizer = _as_gefen_optimizer_config(config.optimizer)
    config.checkpoint = _as_gefen_checkpoint_config(config.checkpoint)
    config.dataloader = lift_dataloader_config(config.dataloader)
    loader_table = data.get("dataloader")
    if isinstance(loader_table, dict) and "loader" in loader_table:
        config.dataloader = _choose_dataloader(config.dataloader, loader_table.pop("loader"), f"{path}: [dataloader] loader")
    sections = {
        f.name
        for f in dataclasses.fields(type(config))
        if f.name != "model_spec" and dataclasses.is_dataclass(getattr(config, f.name))
    }
    for section, table in data.items():
        if section not in sections:
            raise RecipeError(
                f"{path}: [{section}] unknown section (known: job, model, {', '.join(sorted(sections))})"
            )
        if not isinstance(table, dict):
            raise RecipeError(f"{path}: {section} must be a [{section}] section")
        where = f"{path}: [{section}] "
        current = getattr(config, section)
        new = _coerce(table, hints.get(section, Any), where, current)
        if new is not current:
            setattr(config, section, new)

    optimizer_table = data.get("optimizer", {})
    return Recipe(
        path=path,
        config=config,
        module=module,
        base_config=base_config,
        flavor=model.get("flavor") or getattr(config.model_spec, "flavor", None),
        attn_backend=model.get("attn_backend"),
        description=str(job.get("description", "")),
        set_by={f"optimizer.{k}": f"{path}: [optimizer] {k}" for k in GROUP_DEFAULTS if k in optimizer_table}
        | ({"hf_assets_path": f"{path}: [job] hf_assets_path"} if "hf_assets_path" in job else {}),
    )


def finish_recipe(recipe: Recipe, world_size: int | None = None) -> None:
    """Resolve what only the final values decide, and refuse what no run can use.

    Runs on the config as the command line left it (``recipe.set_by`` names
    where a value was set, for the errors), before any process group exists.
    """
    config, path = recipe.config, recipe.path
    if config.hf_assets_path.startswith(BUILTIN_PREFIX):
        where = recipe.set_by.get("hf_assets_path", f"{path}: [job] hf_assets_path")
        config.hf_assets_path = _builtin_asset(config.hf_assets_path, where)
    _check_optimizer(config.optimizer, recipe)
    validate_mesh(config, path, world_size)
    _check_global_order_batch(config, path, world_size)


def _check_optimizer(opt: GefenOptimizersContainer.Config, recipe: Recipe) -> None:
    """No [optimizer] key set without effect, no group key its optimizer ignores."""
    try:
        opt.check_param_groups()
    except ValueError as e:
        raise RecipeError(f"{recipe.path}: [optimizer] {e}") from None
    for key in opt.unused_defaults():
        where = recipe.set_by.get(f"optimizer.{key}")
        if where is None:  # a default nobody set: nothing to report
            continue
        group_key = "optimizer_name" if key == "name" else f"optimizer_kwargs.{key}"
        raise RecipeError(
            f"{where}: has no effect: every [[optimizer.param_groups]] sets its own {group_key}. "
            f"[optimizer] {key} is the default of the groups that leave it out: leave it out of the "
            f"groups that should use it, or do not set [optimizer] {key}"
        )


def _merge(data: dict[str, Any], overrides: dict[str, Any], path: str, where: str = "") -> None:
    for key, value in overrides.items():
        if isinstance(value, dict):
            sub = data.setdefault(key, {})
            if not isinstance(sub, dict):
                raise RecipeError(f"{path}: {where}{key} is a value, not a section")
            _merge(sub, value, path, f"{where}{key}.")
        else:
            data[key] = value


def validate_mesh(config: Any, path: str, world_size: int | None = None) -> None:
    """Degrees must multiply to the world size (``dp_shard = -1`` fills in).

    Mirrors ``ParallelDims._validate`` but runs before any process group work
    and names the recipe keys instead of asserting.
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    p = config.parallelism
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    for key, degree in degrees.items():
        if degree < 1:
            raise RecipeError(f"{path}: [parallelism] {key} must be >= 1, got {degree}")
    others = 1
    for degree in degrees.values():
        others *= degree
    shard = p.data_parallel_shard_degree
    listing = " * ".join(f"{k}({v})" for k, v in degrees.items())
    if shard == -1:
        if world_size % others:
            raise RecipeError(
                f"{path}: [parallelism] impossible mesh: {listing} = {others} does not "
                f"divide the world size {world_size}; data_parallel_shard_degree = -1 "
                "cannot fill the rest. Change the degrees or the number of processes."
            )
        return
    if shard < 1:
        raise RecipeError(f"{path}: [parallelism] data_parallel_shard_degree must be -1 or >= 1, got {shard}")
    if shard * others != world_size:
        raise RecipeError(
            f"{path}: [parallelism] impossible mesh: data_parallel_shard_degree({shard}) * "
            f"{listing} = {shard * others}, but the world size is {world_size}. Set "
            "data_parallel_shard_degree = -1 to use all ranks, or launch "
            f"{shard * others} processes."
        )
