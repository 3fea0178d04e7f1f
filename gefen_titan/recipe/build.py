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

    [model]                              # rebuilt with <module>.model_registry,
    flavor = "debugmodel"                #   with the base config's converters
    attn_backend = "flex"                #   unless [[model.converters]] says

    [[model.converters]]                 # replaces the base's (converters = []
    kind = "lora"                        #   drops them); the other keys are the
    rank = 8                             #   converter Config's fields

    [optimizer]                          # GefenOptimizersContainer.Config
    name = "Gefen"                       # with [[optimizer.param_groups]]:
    lr = 3e-3                            #   for every group that sets none

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

This module builds the torchtitan config: the base config function, its
optimizer, checkpoint and data-loader configs lifted into gefen-titan's
(each component's ``Config.from_torchtitan``; the loaders, training's and
the validator's, through ``gefen_titan.data.registry``, which also owns the
loader names, so this layer names no component kind), the model rebuilt from ``[model]`` (with
``flavors``, ``moe_flavors``; its converters: ``converters``), and the
``builtin://`` assets. The rest of the recipe layer, below it: ``files``
(TOML, ``extends``, override tables), ``coerce`` (the generic TOML ->
dataclass engine), ``checks`` (what ``finish_recipe`` refuses).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

from gefen_titan.checkpoint.manager import GefenCheckpointManager
from gefen_titan.data.corpus import DEFAULT_TOKENIZER_PATH
from gefen_titan.data.registry import (
    UnknownLoaderError,
    lift_dataloader_config,
    lift_validation_dataloader_config,
    loader_config_class,
)
from gefen_titan.optim import option_routes
from gefen_titan.optim import registry as optimizers
from gefen_titan.optim.container import GROUP_DEFAULTS, GefenOptimizersContainer
from gefen_titan.recipe import converters as model_converters
from gefen_titan.recipe import fault_tolerance, log_once
from gefen_titan.recipe.checks import check_global_order_batch, check_optimizer, validate_mesh
from gefen_titan.recipe.coerce import coerce_value, type_hints
from gefen_titan.recipe.errors import RecipeError
from gefen_titan.recipe.files import merge_tables, read_recipe_tables
from gefen_titan.recipe.flat_keys import lift_flat_keys

__all__ = ["BUILTIN_PREFIX", "EXTRA_FLAVORS", "JOB_KEYS", "MODEL_KEYS", "Recipe", "build_recipe", "option_refusal",
           "finish_recipe", "load_recipe"]

JOB_KEYS = ("module", "base_config", "extends", "description", "dump_folder", "hf_assets_path")
MODEL_KEYS = ("flavor", "attn_backend")  # also command-line flags (recipe.cli)
# [model] keys of the TOML only: arrays of tables, no flag.
_MODEL_TABLES = ("converters",)
# torchtitan model packages gefen-titan adds flavors to -> the module whose
# register_flavors() does it: llama3's "150M", the small MoE flavors
# (qwen3's "debugmodel_moe_8e", "debugmodel_moe_2e", deepseek_v3's "debugmodel_small").
EXTRA_FLAVORS = {"llama3": "gefen_titan.recipe.flavors", "qwen3": "gefen_titan.recipe.moe_flavors",
                 "deepseek_v3": "gefen_titan.recipe.moe_flavors"}
# Top-level Trainer.Config scalars that recipes set from [job].
_TOP_LEVEL_FROM_JOB = ("dump_folder", "hf_assets_path")


# ``hf_assets_path = "builtin://tokenizer"`` names the tokenizer shipped in the
# package, wherever it is installed (recipes cannot know site-packages).
BUILTIN_PREFIX = "builtin://"


def _builtin_asset(value: str, where: str) -> str:
    assets = {"tokenizer": DEFAULT_TOKENIZER_PATH}
    name = value[len(BUILTIN_PREFIX):]
    if name not in assets:
        known = ", ".join(BUILTIN_PREFIX + a for a in assets)
        raise RecipeError(f"{where}: unknown built-in asset {value!r} (known: {known})")
    return assets[name]


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


def _choose_dataloader(current: Any, kind: Any, where: str) -> Any:
    """``[dataloader] loader``: keep ``current`` if it is already of that kind,
    else a fresh config of the chosen class (its defaults, then the section's keys)."""
    try:
        cls = loader_config_class(kind)
    except UnknownLoaderError as e:
        raise RecipeError(f"{where}: {e}") from None
    return current if type(current) is cls else cls()


def _rebuild_model_spec(
    config: Any, module: str, flavor: str | None, attn_backend: str | None, converters: list[Any], where: str
) -> None:
    """Rebuild ``model_spec`` from ``<module>.model_registry`` for [model],
    with ``converters`` (the base config's, or the recipe's own)."""
    spec = config.model_spec
    flavor = flavor or (spec.flavor if spec is not None else None)
    if flavor is None:
        raise RecipeError(f"{where} flavor: the base config has no model; set a flavor")
    mod = importlib.import_module(f"torchtitan.models.{module}")
    if module in EXTRA_FLAVORS:
        # Imported here, not at the top: each flavors module imports its
        # torchtitan model package (seconds), which `import gefen_titan` must
        # not pay for (this recipe's is loaded by now).
        importlib.import_module(EXTRA_FLAVORS[module]).register_flavors()
    registry = getattr(mod, "model_registry", None)
    if registry is None:
        raise RecipeError(f"{where}: torchtitan.models.{module} has no model_registry")
    kwargs: dict[str, Any] = {"converters": converters}
    if attn_backend is not None:
        kwargs["attn_backend"] = attn_backend
    try:
        config.model_spec = registry(flavor, **kwargs)
    except KeyError:
        # The registry dict is <module>_configs, but deepseek_v3's is deepseekv3_configs.
        flavors = sorted(getattr(mod, f"{module}_configs", None) or getattr(mod, f"{module.replace('_', '')}_configs",
                                                                               None) or [])
        raise RecipeError(
            f"{where} flavor: unknown flavor {flavor!r} for {module}"
            + (f" (known: {', '.join(flavors)})" if flavors else "")
        ) from None
    except (ValueError, TypeError, AssertionError) as e:
        raise RecipeError(f"{where}: {e}") from None
    except ImportError as e:  # float8 / mxfp8 / nvfp4 need torchao (and a GPU to run)
        raise RecipeError(f"{where} converters: {e} (float8, mxfp8 and nvfp4 need torchao and a GPU)") from None
    # The base function sized the loss for its own model.
    loss_fn = getattr(getattr(config, "loss", None), "loss_fn", None)
    if loss_fn is not None and hasattr(loss_fn, "global_vocab_size"):
        # Not at the top: torchtitan's model code takes seconds to import, and
        # `import gefen_titan` must not pay for it (the base config has loaded it by now).
        from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: PLC0415

        loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)


def option_refusal(key: str) -> str | None:
    """Why an [optimizer] key (``name``, or ``table.name`` in a kind's table)
    is refused: an option of the optimizer a composite name stands for
    (gefen-x's GefenMuonHybrid keywords) with no field here, set flat or in
    the composite's table, or a gefen-x option of a kind whose place is not
    that table or that is refused (``optim.option_routes.table_refusal``); None
    for any other key."""
    table, _, name = key.rpartition(".")
    config = GefenOptimizersContainer.config_class()
    if not table and (name in {f.name for f in dataclasses.fields(config)} or name in config.flat_keys()):
        return None
    for composite in map(optimizers.composite, optimizers.composite_names()):
        why = composite.refused_keys.get(name) if table in ("", composite.options) else None
        if why is not None:
            return f"gefen-x's {composite.name} option is not supported: {why}"
    return option_routes.table_refusal(table, name)


def _refuse_option_keys(table: Any, path: str) -> None:
    if not isinstance(table, dict):
        return
    keys = [*table, *(f"{k}.{n}" for k, v in table.items() if isinstance(v, dict) for n in v)]  # and its tables'
    for key in keys:
        if (why := option_refusal(key)) is not None:
            raise RecipeError(f"{path}: [optimizer] {key}: {why}")


def _base_config(module: str, base_config: str, path: str) -> tuple[Any, list[Any] | None]:
    """The base function's config and the converters its model was built
    with (None: not seen; ``converters.call_base_config``)."""
    try:
        registry = importlib.import_module(f"torchtitan.models.{module}.config_registry")
    except ImportError as e:
        raise RecipeError(f"{path}: [job] module: cannot import torchtitan.models.{module} ({e})") from None
    fn = getattr(registry, base_config, None)
    if not callable(fn):
        known = [n for n in dir(registry)
                 if not n.startswith("_") and n[0].islower() and callable(getattr(registry, n))]
        raise RecipeError(
            f"{path}: [job] base_config: {base_config!r} is not a config function "
            f"of torchtitan.models.{module} (known: {', '.join(sorted(known))})"
        )
    return model_converters.call_base_config(registry, fn)


def _own_section(data: dict[str, Any], name: str, known: tuple[str, ...], path: str) -> dict[str, Any]:
    """Pop one of the sections the recipe layer itself interprets ([job], [model])."""
    table = data.pop(name, {})
    if not isinstance(table, dict):
        raise RecipeError(f"{path}: {name} must be a [{name}] section")
    for key in table:
        if key not in known:
            raise RecipeError(f"{path}: [{name}] {key}: unknown key (known: {', '.join(known)})")
    return table


def load_recipe(
    path: str | os.PathLike, overrides: dict[str, dict[str, Any]] | None = None, *, world_size: int | None = None
) -> Recipe:
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
    # Before the first config is constructed: torchtitan warns on each construction (log_once).
    log_once.install()
    path = str(path)
    data = read_recipe_tables(path)  # each file's older flat [optimizer] keys lifted before it is merged
    merge_tables(data, overrides or {}, path)

    job = _own_section(data, "job", JOB_KEYS, path)
    module = job.get("module", "llama3")
    base_config = job.get("base_config")
    if not isinstance(module, str) or not isinstance(base_config, str):
        raise RecipeError(
            f"{path}: [job] needs module and base_config strings (e.g. base_config = \"llama3_debugmodel\")"
        )
    config, base_converters = _base_config(module, base_config, path)
    if fault_tolerance.SECTION in data:  # torchtitan's FT trainer, with gefen-titan's parts
        config = fault_tolerance.as_fault_tolerant(config)
    hints = type_hints(type(config))
    for key in _TOP_LEVEL_FROM_JOB:
        if key in job:
            setattr(config, key, coerce_value(job[key], hints[key], f"{path}: [job] {key}"))

    model = _own_section(data, "model", MODEL_KEYS + _MODEL_TABLES, path)
    for key in MODEL_KEYS:
        if key in model and not isinstance(model[key], str):
            raise RecipeError(f"{path}: [model] {key}: expected a string, got {model[key]!r}")
    if "converters" in model:  # the recipe's own, in place of the base config's
        converters = model_converters.converters_from_recipe(model["converters"], f"{path}: [model] converters")
    elif base_converters is None and model and config.model_spec is not None:
        model_registry = importlib.import_module(f"torchtitan.models.{module}").model_registry
        model_converters.check_unrecorded(config, model_registry, f"{path}: [model]")
        converters = []
    else:
        converters = base_converters or []
    if model:
        _rebuild_model_spec(config, module, model.get("flavor"), model.get("attn_backend"), converters,
                            f"{path}: [model]")

    # config_class(): the Config with a table for every registered kind (one registered after import too).
    config.optimizer = GefenOptimizersContainer.config_class().from_torchtitan(config.optimizer)
    _refuse_option_keys(data.get("optimizer"), path)
    lift_flat_keys(data.get("optimizer"), path)
    config.checkpoint = GefenCheckpointManager.Config.from_torchtitan(config.checkpoint)
    if fault_tolerance.SECTION in data:
        fault_tolerance.lift_components(config)
    config.dataloader = lift_dataloader_config(config.dataloader)
    loader_table = data.get("dataloader")
    if isinstance(loader_table, dict) and "loader" in loader_table:
        where = f"{path}: [dataloader] loader"
        config.dataloader = _choose_dataloader(config.dataloader, loader_table.pop("loader"), where)
    if hasattr(config.validator, "dataloader"):  # torchtitan's Validator (a custom one may read none)
        config.validator.dataloader = lift_validation_dataloader_config(config.validator.dataloader)
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
        new = coerce_value(table, hints.get(section, Any), where, current)
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
    check_optimizer(config.optimizer, path, recipe.set_by)
    fault_tolerance.check_fault_tolerance(config, path)
    validate_mesh(config, path, world_size)
    check_global_order_batch(config, path, world_size)
