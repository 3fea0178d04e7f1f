"""The data loaders a recipe can pick, by name: ``[dataloader] loader = "..."``.

A loader is a torchtitan data-loader component (its ``Config`` builds it);
this registry maps the name a recipe uses to that ``Config`` class, and the
recipe layer (``gefen_titan.recipe.build``) applies the section's other keys
as the fields of that class. The built-in loaders:

* ``"elastic"`` (the default): ``ElasticTextDataLoader``, torchtitan's text
  loader that resumes at another data-parallel size
  (``gefen_titan.data.elastic``, ``docs/data_resume.md``);
* ``"global_order"``: ``GlobalOrderDataLoader``, global batches that are the
  same samples at every data-parallel size
  (``gefen_titan.data.global_loader``, ``docs/data_order.md``).

A new loader is one module with its component plus one
``register_loader(name, MyLoader.Config)`` call, made before the recipe is
read; ``dp_invariant=True`` says its batches are the same samples at every
data-parallel size (``is_dp_invariant``: the recipe checks then require a
fixed global batch, and fault tolerance requires such a loader), so the
recipe layer names no loader itself. The built-ins are registered here, when this module is imported (the
recipe layer imports it), not by importing ``gefen_titan``: the registry is
this module's dict, and nothing outside the package changes.

``lift_dataloader_config`` turns the ``HuggingFaceTextDataLoader.Config``
that torchtitan's base config functions build into the default loader's
config, so a recipe that names no loader still resumes elastically;
``lift_validation_dataloader_config`` does the same for the validator's
loader (``[validator.dataloader]``): torchtitan's becomes
``EvalTextDataLoader``, whose pass over the whole set is exact and the same
length on every rank (``gefen_titan.data.eval_loader``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.components.dataloader import BaseDataLoader

from gefen_titan.data.elastic import ElasticTextDataLoader
from gefen_titan.data.eval_loader import EvalTextDataLoader
from gefen_titan.data.global_loader import GlobalOrderDataLoader
from gefen_titan.errors import UserError

__all__ = [
    "DEFAULT_LOADER",
    "UnknownLoaderError",
    "dp_invariant_names",
    "is_dp_invariant",
    "lift_dataloader_config",
    "lift_validation_dataloader_config",
    "loader_config_class",
    "loader_names",
    "register_loader",
]

DEFAULT_LOADER = "elastic"
"""The loader of a recipe that names none (what ``lift_dataloader_config`` makes)."""

_LOADERS: dict[str, type[BaseDataLoader.Config]] = {}
_DP_INVARIANT: set[str] = set()  # names registered with dp_invariant=True


class UnknownLoaderError(UserError, ValueError):
    """A loader name nobody registered; the message lists the known ones."""


def register_loader(name: str, config_cls: type[BaseDataLoader.Config], *, dp_invariant: bool = False) -> None:
    """Make ``[dataloader] loader = name`` build ``config_cls``'s component.

    ``dp_invariant``: its global batches are the same samples at every
    data-parallel size and its one position means the same batches in every
    replica group; that holds only with a fixed global batch, which the
    recipe checks then require (``is_dp_invariant``).

    ``config_cls`` must be a ``BaseDataLoader.Config`` dataclass (what
    ``Trainer.Config.dataloader`` holds) whose fields all have defaults: the
    recipe layer starts from ``config_cls()`` and sets the section's keys.
    Registering the same class again is a no-op; another class under a taken
    name is refused rather than silently replacing a loader.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, BaseDataLoader.Config)
            and dataclasses.is_dataclass(config_cls)):
        raise TypeError(f"loader {name!r}: {config_cls!r} is not a BaseDataLoader.Config dataclass")
    existing = _LOADERS.get(name)
    if existing is not None and existing is not config_cls:
        raise ValueError(
            f"loader {name!r} is already registered as {existing.__qualname__}; "
            f"choose another name for {config_cls.__qualname__}"
        )
    _LOADERS[name] = config_cls
    if dp_invariant:
        _DP_INVARIANT.add(name)


def is_dp_invariant(cfg: Any) -> bool:
    """Whether ``cfg`` is the config of a loader registered with ``dp_invariant=True``."""
    return any(isinstance(cfg, _LOADERS[name]) for name in _DP_INVARIANT)


def dp_invariant_names() -> str:
    """Those loaders as a recipe names them, for messages (``"global_order"``)."""
    return " or ".join(f'"{name}"' for name in _LOADERS if name in _DP_INVARIANT)


def loader_names() -> list[str]:
    """The registered names, in registration order (the built-ins first)."""
    return list(_LOADERS)


def loader_config_class(name: Any) -> type[BaseDataLoader.Config]:
    """The ``Config`` class registered as ``name``.

    Raises ``UnknownLoaderError`` ("must be one of [...], got ..."), which the
    recipe layer prefixes with the file and key.
    """
    cls = _LOADERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise UnknownLoaderError(f"must be one of {loader_names()}, got {name!r}")
    return cls


def lift_dataloader_config(cfg: Any) -> Any:
    """A base config function's data-loader config as the default loader's
    (``ElasticTextDataLoader.Config.from_torchtitan``: torchtitan's
    ``HuggingFaceTextDataLoader.Config``, same field values); any other
    config, including ours, is returned as is."""
    return ElasticTextDataLoader.Config.from_torchtitan(cfg)


def lift_validation_dataloader_config(cfg: Any) -> Any:
    """The validator's data-loader config (torchtitan's
    ``HuggingFaceTextDataLoader.Config``, its default) as
    ``EvalTextDataLoader.Config`` with the same values: with
    ``validator.steps = -1`` it reads a map-style set once, exactly, with no
    rank running out first. Any other config is returned as is."""
    return EvalTextDataLoader.Config.from_torchtitan(cfg)


register_loader(DEFAULT_LOADER, ElasticTextDataLoader.Config)  # torchtitan's text loader + on_dp_change
register_loader("global_order", GlobalOrderDataLoader.Config, dp_invariant=True)  # same batches at any DP size
