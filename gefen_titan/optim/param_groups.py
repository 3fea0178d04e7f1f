"""How ``[optimizer]`` becomes the param groups the container builds: the shorthand, the groups'
optimizers and kwargs, and the checks of what the groups set.

This is the resolution logic of ``GefenOptimizersContainer.Config``, kept out
of the Config (which, as torchtitan's, is data: it has no methods of these
names) so the container module holds the container. Each function takes the
Config: ``param_groups.resolved_param_groups(config)``. ``resolve_factory``
is the container's name -> factory lookup (the registry's, then torchtitan's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from gefen_titan.optim import option_routes, registry

__all__ = ["GROUP_DEFAULTS", "SHORTHAND_DEFAULTS", "check_param_groups", "hyperparameters", "resolve_factory",
           "resolved_param_groups", "shorthand", "shorthand_set", "unused_defaults"]

# [optimizer] keys that can stand for a param group's own: ``name`` for a
# group without ``optimizer_name``, the others (once set) for a group of a
# registered optimizer whose ``optimizer_kwargs`` leave them out.
GROUP_DEFAULTS = ("name", "lr", "betas", "eps", "weight_decay")

# The catch-all group's values of the shorthand keys left unset (None). Only
# that group takes them: it is the shorthand's own group, while a group of
# explicit param_groups is torchtitan's, whose unset keys are its optimizer's
# defaults (AdamW: weight_decay 0.01; Adam: coupled L2, default 0).
SHORTHAND_DEFAULTS: dict[str, Any] = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def shorthand(config: Any) -> dict[str, Any]:
    """lr, betas, eps and weight_decay as the catch-all group (and a
    composite's groups) take them: the values set, else ``SHORTHAND_DEFAULTS``."""
    values = {k: getattr(config, k) for k in SHORTHAND_DEFAULTS}
    values = {k: SHORTHAND_DEFAULTS[k] if v is None else v for k, v in values.items()}
    return {**values, "betas": tuple(values["betas"])}


def shorthand_set(config: Any) -> dict[str, Any]:
    """The shorthand keys set (not None), which stand for a group's own."""
    return {k: tuple(v) if k == "betas" else v for k in SHORTHAND_DEFAULTS
            if (v := getattr(config, k)) is not None}


def hyperparameters(config: Any, name: str | None = None) -> dict[str, Any]:
    """The catch-all group's hyperparameters, those optimizer ``name``
    (default: ``name``) takes (its registry entry's ``shorthand_keys``;
    optimizer-wide options are added by the container)."""
    spec = registry.get(name or config.name)
    keys = spec.shorthand_keys if spec is not None else registry.SHORTHAND_KEYS
    values = shorthand(config)
    return {k: values[k] for k in keys}


def resolved_param_groups(config: Any) -> list[ParamGroupConfig]:
    """The groups the container builds, each with its optimizer and kwargs.

    Without param_groups: one catch-all group (``hyperparameters``), or
    a composite name's groups. With them, a group without
    ``optimizer_name`` is of ``name``; a group of a registered
    optimizer takes those of its ``shorthand_keys`` (lr, betas, eps,
    weight_decay; GefenMuon: lr and weight_decay) that this section
    sets and its ``optimizer_kwargs`` leave out. Every other key it
    leaves out is not filled in, so the optimizer's own default
    applies, as in torchtitan. Other optimizers' groups (a base
    config's, e.g. DistMuon) are kept as they are.
    """
    composite = registry.composite(config.name)
    if composite is not None and not config.param_groups:
        return composite.param_groups(config)
    if not config.param_groups:
        return [
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name=config.name,
                optimizer_kwargs=hyperparameters(config),
            )
        ]
    groups = []
    for i, g in enumerate(config.param_groups):
        name = g.optimizer_name or config.name
        if registry.composite(name) is not None:
            raise ValueError(
                f"param_groups[{i}]: {name} is no optimizer of a param group: [optimizer] name = "
                f"\"{name}\" without [[optimizer.param_groups]] expands into its groups; with them, "
                f"give each group its optimizer_name ({', '.join(registry.names())})")
        kwargs = dict(g.optimizer_kwargs)
        if (spec := registry.get(name)) is not None:
            set_keys = shorthand_set(config)
            kwargs = {**{k: set_keys[k] for k in spec.shorthand_keys if k in set_keys}, **kwargs}
        groups.append(ParamGroupConfig(pattern=g.pattern, optimizer_name=name, optimizer_kwargs=kwargs))
    return groups


def unused_defaults(config: Any) -> list[str]:
    """The ``GROUP_DEFAULTS`` keys that no param group takes (of lr,
    betas, eps and weight_decay: those set)."""
    if not config.param_groups:
        return []
    unused = []
    if all(g.optimizer_name for g in config.param_groups):
        unused.append("name")
    for key in shorthand_set(config):
        if not any((spec := registry.get(g.optimizer_name or config.name)) is not None
                   and key in spec.shorthand_keys and key not in g.optimizer_kwargs
                   for g in config.param_groups):
            unused.append(key)
    return unused


def resolve_factory(name: str) -> Callable[..., Optimizer]:
    """The factory of optimizer ``name``: its registry entry's, else torchtitan's own (DistMuon, and whatever a
    later torchtitan adds), which raises NotImplementedError for a name it does not know either."""
    spec = registry.get(name)
    if spec is not None:
        return spec.factory
    return OptimizersContainer._resolve_optimizer_factory(name)  # noqa: SLF001 (torchtitan's own dict)


def check_param_groups(config: Any) -> None:
    """Refuse group settings that would build an optimizer that ignores
    them: an optimizer no factory knows, an ``optimizer_kwargs`` key
    the group's optimizer does not read (torch and gefen-x keep unknown
    group keys without a word), a gefen-x option given as a group key or
    factory kwarg whose place is elsewhere or that is refused
    (``optim.option_routes``), factory kwargs for an optimizer no
    group uses, a GefenMuonHybrid key where the hybrid is not built."""
    for name in registry.composite_names():
        registry.composite(name).check(config)
    names = set()
    for i, g in enumerate(resolved_param_groups(config)):
        where = f"param_groups[{i}]" if config.param_groups else "name"
        try:
            resolve_factory(g.optimizer_name)
        except NotImplementedError:
            raise ValueError(
                f"{where}: unknown optimizer {g.optimizer_name!r} (known: {', '.join(registry.names())})"
            ) from None
        names.add(g.optimizer_name)
        spec = registry.get(g.optimizer_name)
        if spec is None:  # torchtitan's own (DistMuon): its factory checks its kwargs
            continue
        if spec.needs_agreed_blocking and config.blocking.mode != "agreed":
            raise ValueError(f"{where}: {g.optimizer_name} {spec.needs_agreed_blocking}")
        known = spec.group_keys
        for key in g.optimizer_kwargs:
            if (why := option_routes.refusal(spec, key, "group")) is not None:
                raise ValueError(f"{where} optimizer_kwargs: {why}")
            if key not in known:
                hint = spec.group_key_hint(key)
                raise ValueError(
                    f"{where} optimizer_kwargs: {g.optimizer_name} does not read {key!r} in a "
                    f"param group (it reads {', '.join(known)}){hint}"
                )
    option_routes.refuse_factory_kwargs(config.optimizer_factory_kwargs_by_name)
    for name in config.optimizer_factory_kwargs_by_name:
        if name not in names:
            raise ValueError(
                f"optimizer_factory_kwargs_by_name: no param group uses {name!r} "
                f"(the groups use {', '.join(sorted(names))})"
            )
