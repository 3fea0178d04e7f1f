"""What every gefen-x kind's factory does to torchtitan-style param groups: the optimizer-wide
options taken out of them, and the FQNs kept where checkpoints find them."""

from __future__ import annotations

from typing import Any

import torch

from gefen_titan.optim import gefenx as gx

__all__ = ["IMPL_KEYS", "split_options"]

# Keys torchtitan's container puts into every param group from
# ``implementation``. Gefen takes ``fused`` as a constructor argument (it would
# silently carry a group-level ``fused`` as an unused extra key) and has no
# foreach path.
IMPL_KEYS = ("fused", "foreach")



def split_options(param_groups: list[dict[str, Any]], option_keys: tuple[str, ...], name: str
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(groups, constructor options) from torchtitan-style param groups.

    Groups carry ``param_names`` (canonical FQNs); gefen-x stores them,
    lowercased, as the per-parameter state name, so they are also kept as
    they are under ``gefenx.FQNS_KEY``, which is how checkpoints identify
    parameters (``gefenx.named_params``).

    Optimizer-wide options (``fused``, ``deterministic``, ...) are constructor
    arguments, not group options: they are taken from the first group (the
    container gives every group of the optimizer the same ones) and removed
    from all of them so they are not carried along as meaningless group keys.
    """
    options: dict[str, Any] = {}
    groups = []
    for group in param_groups:
        group = dict(group)
        for key in IMPL_KEYS + option_keys:
            if key in group:
                value = group.pop(key)
                if key in options and options[key] != value:
                    raise ValueError(
                        f"{name} option {key!r} must be the same for every {name} "
                        f"param group (got {options[key]!r} and {value!r}); it is "
                        "a property of the optimizer, not of a group."
                    )
                options[key] = value
        names_ = group.pop("param_names", None)
        if names_ is not None:
            # gefen-x takes names only as (name, tensor) pairs; a bare
            # "param_names" key would be ignored in favour of positional names.
            group["params"] = list(zip(names_, group["params"], strict=True))
            group[gx.FQNS_KEY] = list(names_)  # gefen-x lowercases its own copy (gefenx.named_params)
        groups.append(group)
    options.pop("foreach", None)
    # gefen-x's fused path is CUDA-only and downgrades itself with a warning per
    # optimizer otherwise; decide here so CPU runs stay quiet.
    options["fused"] = bool(options.get("fused", False)) and torch.cuda.is_available()
    return groups, options
