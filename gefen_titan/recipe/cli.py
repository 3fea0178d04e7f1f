"""``train.py``'s command line: a TOML recipe, then torchtitan's CLI over it.

torchtitan 0.3.0's ``ConfigManager`` takes ``--module/--config`` off the
command line, calls that config function, and lets tyro parse the rest with
the config it returned as the default. Here the recipe (``--job.config``)
builds the config instead (``gefen_titan.recipe.build``, with its file-and-key
errors), and the same tyro call with torchtitan's own parsing rules parses
the rest over it. So the flags are torchtitan's: ``--training.steps 50``,
top-level ``--dump-folder`` / ``--dump_folder`` and ``--hf-assets-path``,
``--metrics.enable-tensorboard`` / ``--metrics.no-enable-tensorboard``,
``--checkpoint.exclude-from-loading dataloader,optimizer``,
``--optimizer.betas 0.9 0.95``, ``activation-checkpoint:full``, and
``--help`` lists every section and key with its type and the recipe's value
as the default.

A few flags are the recipe's own, because they change how the config is
built rather than a value in it (``RECIPE_FLAGS``); they are taken off first
and applied as recipe keys: ``--job.config PATH``, ``--job.<key>`` (module,
base_config, description, dump_folder, hf_assets_path), ``--model.flavor``,
``--model.attn_backend``, ``--dataloader.loader``,
``--activation_checkpoint.mode``. For bool keys ``--flag true`` / ``--flag
false`` also work (the form the recorded reference commands use).

Every error, tyro's included, is a ``RecipeError`` raised before any process
group exists, the same on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import typing
from typing import Any

import tyro
from torchtitan.config.manager import ConfigManager

from gefen_titan.data.registry import loader_names
from gefen_titan.optim.container import GROUP_DEFAULTS, GefenOptimizersContainer
from gefen_titan.recipe.build import JOB_KEYS, MODEL_KEYS, Recipe, build_recipe, finish_recipe, option_refusal
from gefen_titan.recipe.coerce import type_hints
from gefen_titan.recipe.errors import RecipeError

__all__ = ["CommandLine", "RECIPE_FLAGS", "USAGE", "load_cli", "parse_cli", "parse_flags"]

# section -> keys that are recipe keys on the command line (see module doc).
RECIPE_FLAGS: dict[str, tuple[str, ...]] = {
    "job": tuple(k for k in JOB_KEYS if k != "extends") + ("config",),
    "model": MODEL_KEYS,
    "dataloader": ("loader",),
    "activation_checkpoint": ("mode",),
}

# The loader choices are the registry's names when this module is imported (the built-ins).
USAGE = f"""\
usage: train.py --job.config RECIPE.toml [FLAGS ...]

Trains what the TOML recipe describes (e.g. recipes/llama_gefen.toml). FLAGS
are torchtitan's over the recipe's values (--training.steps 50, --dump-folder
/tmp/run, --metrics.enable-tensorboard, ...); add --help after --job.config to
list every section and key of that recipe with its type and value.

Recipe flags (applied as recipe keys, before the others):
  --job.config PATH           the recipe (required)
  --job.dump_folder DIR       same as --dump-folder
  --job.hf_assets_path DIR    same as --hf-assets-path (builtin://tokenizer: the
                              tokenizer shipped with gefen_titan)
  --job.module NAME, --job.base_config NAME, --job.description TEXT
  --model.flavor NAME, --model.attn_backend NAME   rebuild the model spec
  --dataloader.loader {{{",".join(loader_names())}}}       pick the data loader class
  --activation_checkpoint.mode {{none,selective,full,memory_budget}}

Bools: --section.key, --section.no-key, or --section.key true|false.
"""


@dataclasses.dataclass
class CommandLine:
    """``argv`` split into what the recipe takes and what tyro parses."""

    path: str | None
    """``--job.config`` (None only with --help)."""
    overrides: dict[str, dict[str, Any]]
    """The ``RECIPE_FLAGS`` given, as recipe tables (section -> key -> str)."""
    args: list[str]
    """Everything else, in order, for tyro."""
    help: bool = False


def parse_cli(argv: list[str]) -> CommandLine:
    """Take the recipe flags (``RECIPE_FLAGS``) off ``argv``.

    Only those are interpreted here (each takes one value, ``--k v`` or
    ``--k=v``; dashes may stand for underscores); every other argument goes
    to tyro untouched.
    """
    path = None
    overrides: dict[str, dict[str, Any]] = {}
    args: list[str] = []
    help_ = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            help_ = True
            args.append(arg)
            continue
        if not arg.startswith("--"):
            args.append(arg)
            continue
        name, eq, value = arg[2:].partition("=")
        section, _, key = name.replace("-", "_").partition(".")
        if key not in RECIPE_FLAGS.get(section, ()):
            if section == "optimizer" and (why := option_refusal(key)) is not None:
                raise RecipeError(f"command line: --{name}: {why}")
            if section == "job":
                raise RecipeError(
                    f"command line: --{name}: not a recipe flag (known: "
                    f"{', '.join('--job.' + k for k in RECIPE_FLAGS['job'])})"
                )
            args.append(arg)
            continue
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                raise RecipeError(f"command line: --{name} needs a value")
            value = argv[i]
            i += 1
        if (section, key) == ("job", "config"):
            path = value
        else:
            overrides.setdefault(section, {})[key] = value
    if path is None and not help_:
        raise RecipeError("command line: --job.config PATH (a TOML recipe, e.g. recipes/llama_gefen.toml) is required")
    return CommandLine(path, overrides, _lift_flat_flags(args), help_)


def _lift_flat_flags(args: list[str]) -> list[str]:
    """Older flat optimizer flags (``--optimizer.backup_optimizer adamw``, ``--optimizer.deterministic``,
    ``--optimizer.muon_bucket_mib 64``, ``--optimizer.max_tensor_parallel_degree 2``) as their tables'
    (``--optimizer.hybrid.backup_optimizer adamw``, ...; ``Config.flat_keys``), and a table's older plain
    flag (``--optimizer.blocking per_rank``) as its field's (``--optimizer.blocking.mode per_rank``;
    ``Config.scalar_fields``), as the recipe layer reads the TOML keys. A place set both ways is refused."""
    config = GefenOptimizersContainer.config_class()
    flat, scalars, defaults = config.flat_keys(), config.scalar_fields(), config()
    out: list[str] = []
    lifted: dict[str, str] = {}  # place -> the flat flag that set it
    given: set[str] = set()  # optimizer keys set by their own flags (a bool's no- form as the key)
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        name, eq, value = arg.partition("=")
        section, _, key = name[2:].replace("-", "_").partition(".") if name.startswith("--") else ("", "", "")
        prefix, dot, last = key.rpartition(".")
        if section == "optimizer" and not dot and key in scalars:
            lifted[f"{key}.{scalars[key]}"] = name
            out.append(f"--optimizer.{key}.{scalars[key]}{eq}{value}")
            continue
        last = last[3:] if last.startswith("no_") else last
        if section != "optimizer" or dot or last not in flat:
            given.add(f"{prefix}{dot}{last}")
            out.append(arg)
            continue
        table, _, field_ = flat[last][0].partition(".")
        is_bool = isinstance(getattr(getattr(defaults, table), field_), bool)
        takes_next = not eq and i < len(args) and not args[i].startswith("--")
        values = [args[i]] if takes_next and (not is_bool or args[i] in _TRUE + _FALSE) else []
        i += len(values)
        for place in flat[last]:
            lifted[place] = name
            kind, _, new = place.partition(".")
            out += [f"--optimizer.{kind}.{'no_' if key != last else ''}{new}{eq}{value}", *values]
    for place, flag in lifted.items():
        if place in given:
            raise RecipeError(f"command line: {flag} and --optimizer.{place} both given: {flag} is the older "
                              f"spelling of --optimizer.{place}; give only --optimizer.{place}")
    return out


def load_cli(argv: list[str], *, world_size: int | None = None) -> Recipe:
    """The recipe ``argv`` names, with the rest of ``argv`` parsed over it.

    ``--help`` prints the help (the recipe's, with ``--job.config``) and
    raises ``SystemExit(0)``, as tyro and argparse do.
    """
    cl = parse_cli(argv)
    if cl.path is None:
        print(USAGE, end="")
        raise SystemExit(0)
    recipe = build_recipe(cl.path, cl.overrides)
    before = recipe.config
    config = parse_flags(before, cl.args, prog=f"train.py --job.config {cl.path}", description=_description(recipe))
    for key in GROUP_DEFAULTS:
        if getattr(config.optimizer, key) != getattr(before.optimizer, key):
            recipe.set_by[f"optimizer.{key}"] = f"command line: --optimizer.{key.replace('_', '-')}"
    if config.hf_assets_path != before.hf_assets_path:
        recipe.set_by["hf_assets_path"] = "command line: --hf-assets-path"
    recipe.config = config
    finish_recipe(recipe, world_size)
    return recipe


_registry = None


def _tyro_registry() -> Any:
    """tyro's constructor rules as torchtitan's ``ConfigManager`` registers
    them (``list[str]`` as ``a,b,c``, ``--override.imports`` targets)."""
    global _registry
    if _registry is None:
        registry = tyro.constructors.ConstructorRegistry()
        ConfigManager.register_tyro_rules(registry)
        _registry = registry
    return _registry


def parse_flags(config: Any, args: list[str], *, prog: str = "train.py", description: str | None = None) -> Any:
    """tyro over ``config`` as torchtitan's ``ConfigManager.parse_args`` calls
    it; returns a new config (``config`` is left as it was).

    A parse error is a ``RecipeError`` carrying tyro's message; ``--help``
    prints tyro's help and raises ``SystemExit(0)``.
    """
    args = _bool_values_as_flags(list(args), config)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            parsed = tyro.cli(type(config), args=args, default=config, registry=_tyro_registry(),
                              prog=prog, description=description)
    except SystemExit as e:
        if e.code in (0, None):
            sys.stderr.write(captured.getvalue())
            raise
        raise RecipeError("command line: " + _unbox(captured.getvalue())) from None
    sys.stderr.write(captured.getvalue())
    return parsed


def _unbox(text: str) -> str:
    """tyro's boxed error panel as plain text: its title, then each of its
    parts on one line (the panel wraps them at its width)."""
    parts: list[list[str]] = [[]]
    for line in text.splitlines():
        s = line.strip().strip("│").strip()
        if s.startswith("╭"):
            parts += [[s.strip("╭╮─ ") + ":"], []]
            continue
        if not s or s.startswith("╰") or set(s) <= {"─", " "}:
            parts.append([])
            continue
        parts[-1].append(s)
    lines = [" ".join(p) for p in parts if p]
    if len(lines) > 1 and lines[1].startswith(lines[0].rstrip(":")):
        lines.pop(0)  # a title that the message repeats
    elif len(lines) > 1:
        lines[:2] = [f"{lines[0]} {lines[1]}"]
    return "\n".join(lines) or text


_TRUE, _FALSE = ("true", "True", "1", "yes"), ("false", "False", "0", "no")


def _bool_values_as_flags(args: list[str], config: Any) -> list[str]:
    """``--x.flag true|false`` -> tyro's ``--x.flag`` / ``--x.no-flag``, for
    keys whose type in ``config`` is ``bool`` (tyro makes those flags)."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--") or arg == "--help":
            out.append(arg)
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i < len(args) and args[i] in _TRUE + _FALSE:
                value = args[i]
            else:
                out.append(arg)
                continue
        if value not in _TRUE + _FALSE or not _is_bool_field(config, name):
            out.append(arg)
            continue
        if not eq:
            i += 1  # the value was the next argument
        prefix, dot, key = name.rpartition(".")
        out.append(f"--{name}" if value in _TRUE else f"--{prefix}{dot}no-{key}")
    return out


def _is_bool_field(config: Any, name: str) -> bool:
    obj = config
    parts = name.replace("-", "_").split(".")
    for part in parts[:-1]:
        if isinstance(obj, (list, tuple)) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        elif dataclasses.is_dataclass(obj) and hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            return False
    if not dataclasses.is_dataclass(obj):
        return False
    tp = type_hints(type(obj)).get(parts[-1])
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp is bool


def _description(recipe: Recipe) -> str:
    about = f" ({recipe.description})" if recipe.description else ""
    model = f", model flavor {recipe.flavor!r}" if recipe.flavor else ""
    return (
        f"Recipe {recipe.path}{about}: torchtitan.models.{recipe.module} config "
        f"{recipe.base_config!r}{model}. The defaults below are the recipe's values.\n\n"
        + USAGE.split("\n\n", 2)[2]
    )
