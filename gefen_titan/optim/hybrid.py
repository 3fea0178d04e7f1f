"""``[optimizer] name = "GefenMuonHybrid"``: GefenMuon for the hidden matrices, a backup for the rest.

gefen-x's ``GefenMuonHybrid`` is one optimizer object holding a GefenMuon and
a Gefen or AdamW, with a nested state dict of its own. gefen-titan never
builds it: the container expands the name into param groups of two optimizers
it already runs and checkpoints: ``GefenMuon`` (whose step is the sharded
step) for the routed matrices, and ``Gefen`` (``backup_optimizer = "gefen"``,
the default) or ``AdamW`` (``"adamw"``) for everything else. A checkpoint of
the hybrid is therefore made of exactly those optimizers' records: it reshards
bit-exactly like theirs, ``gefen-titan ckpt inspect`` names them, and a
recipe that gives the parameters to other optimizers is refused by the kind
check (``gefen_titan.optim.checkpointing.kinds_refusal``).

Why routing is by module (``route``), not by name: gefen-x's heuristics match
name substrings (``embed``, ``lm_head``, ...), which send a head or an
embedding named otherwise (torchtitan's ``output``) to Muon, where
Newton-Schulz would orthogonalize a vocabulary projection. Here a parameter
goes to GefenMuon when it is, inside the model's transformer blocks (its
``layers`` child, torchtitan's decoders' block container), the 2-D weight
of an ``nn.Linear`` (attention projections, a fused ``wqkv`` included, the
MLP's matrices, an MoE's shared experts) or a 3-D weight of an MoE's
routed experts (torchtitan's ``GroupedExperts``: ``w1_EFD``, ``w2_EDF``,
``w3_EFD``, ``(E, out, in)``, one Muon matrix per expert; in an MoE model
nearly all the parameters). Everything else goes to the backup:
embeddings (``nn.Embedding``, wherever they are), the output head and any
other module outside the blocks, norms, biases (the experts' too), other
1-D and 3-D parameters, and the MoE router's gate (the ``nn.Linear`` of a
``TokenChoiceTopKRouter``). The gate, because torchtitan's own MoE
param-group config (``qwen3_debugmodel_moe_param_groups``) gives it a group
of its own with Adam, no weight decay and a lower lr: it scores experts (a
small E x dim classifier, like the output head that Muon setups leave to
Adam), and orthogonalizing it would flatten the spread of the routing
logits that load balancing relies on. The decision reads module types and the tree,
so FSDP2 / TP wrappers (subclasses of ``nn.Linear``, DTensor parameters) and
pipeline stages (a stage keeps the blocks' original keys) route alike, and
FQNs are canonical (activation checkpointing's and torch.compile's wrapper
segments stripped).

torchtitan's container routes groups by regex over each model part's
parameter names (first match wins); ``bind`` turns the routed sets into
exact-name patterns (a group that matches nothing on a pipeline stage is
dropped there by the container).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch.nn as nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter
from torchtitan.tools.logging import logger

from gefen_titan.optim import gefenx as gx
from gefen_titan.optim import param_groups as groups_of
from gefen_titan.optim.options_table import OptionsTableBase

__all__ = ["BACKUPS", "HybridOptions", "NAME", "OPTION_KEYS", "REFUSED", "SHARED_KEYS", "RoutedGroup", "bind",
           "check", "kind_hint", "param_groups", "route"]

NAME = "GefenMuonHybrid"

# backup_optimizer -> the registry's optimizer of the backup groups.
BACKUPS = {"gefen": "Gefen", "adamw": "AdamW"}

# The model's block container (torchtitan's Decoder.layers).
BLOCKS = "layers"

# The [optimizer.hybrid] fields (``HybridOptions``), named as gefen-x's
# GefenMuonHybrid keywords, with gefen-x's defaults.
OPTION_KEYS = ("backup_optimizer", "muon_lr", "backup_lr", "muon_weight_decay", "backup_weight_decay",
               "no_decay_substrings", "momentum", "nesterov", "ns_steps", "ns_schedule", "adjust_lr_fn",
               "normuon", "normuon_beta2", "normuon_eps")

# gefen-x's keywords that are [optimizer]'s shorthand, shared with every
# optimizer (their defaults are gefen-titan's: lr 8e-4, betas (0.9, 0.95),
# eps 1e-8, weight_decay 0.1; gefen-x's hybrid: lr required, (0.9, 0.999),
# 1e-8, 0.0).
SHARED_KEYS = {
    "lr": "the default of muon_lr and backup_lr",
    "weight_decay": "the default of muon_weight_decay and backup_weight_decay",
    "betas": "the backup's Adam betas",
    "eps": "the backup's Adam eps (GefenMuon's eps, the Newton-Schulz floor, stays gefen-x's 1e-7, as in gefen-x)",
}

# gefen-x's other keywords: no [optimizer] field; a recipe that sets one is
# told why (or where the setting lives in gefen-titan).
REFUSED = {
    "backup_substrings": "gefen-titan routes by module, not by name substrings: the nn.Linear weights inside the "
                         "model's transformer blocks go to GefenMuon, everything else to the backup; for another "
                         "split, spell out [[optimizer.param_groups]]",
    "backup_1d_period_one": "Gefen's 1-D parameters keep per-element state through "
                            "optimizer.gefen.force_1d_period_one (on by default, and agreed blocking needs it on)",
    "backup_2d_period_one": "name the backup's 2-D parameters that should keep per-element state in "
                            "optimizer.gefen.period_one_substrings",
    "fused": "set optimizer.implementation (torchtitan's; Gefen's fused path is CUDA-only)",
    "deterministic": "set optimizer.gefen.deterministic and optimizer.muon.deterministic (each applies to every "
                     "optimizer of its kind)",
    "verbose": "gefen-titan logs through torchtitan's logger",
    **{k: v for k, v in gx.MUON_REFUSED.items() if k != "ns_schedule"},
}


@dataclass(kw_only=True, slots=True)
class HybridOptions(OptionsTableBase):
    """``[optimizer.hybrid]``, GefenMuonHybrid's options (``OPTION_KEYS``), a
    table of ``GefenOptimizersContainer.Config``: gefen-x's GefenMuonHybrid
    keywords with its defaults, read only with ``name = "GefenMuonHybrid"``
    and no param_groups (the shorthand's lr, betas, eps and weight_decay are
    its shared values: ``SHARED_KEYS``). Older recipes set them as flat
    ``[optimizer]`` keys (``FLAT_KEYS``), which the recipe layer still reads."""

    # The flat [optimizer] key of older recipes -> this table's field.
    FLAT_KEYS: ClassVar[dict[str, str]] = {k: k for k in OPTION_KEYS}

    backup_optimizer: Literal["gefen", "adamw"] = "gefen"
    """GefenMuonHybrid: the optimizer of everything but the hidden matrices
    (embeddings, the output head, norms, biases): "gefen" or "adamw"."""
    muon_lr: float | None = None
    """GefenMuonHybrid: GefenMuon's lr (None: lr)."""
    backup_lr: float | None = None
    """GefenMuonHybrid: the backup's lr (None: lr)."""
    muon_weight_decay: float | None = None
    """GefenMuonHybrid: GefenMuon's weight decay (None: weight_decay)."""
    backup_weight_decay: float | None = None
    """GefenMuonHybrid: the backup's weight decay (None: weight_decay)."""
    no_decay_substrings: list[str] = field(default_factory=list)
    """GefenMuonHybrid: backup parameters whose FQN contains one of these
    (case-insensitive) get weight decay 0."""
    momentum: float = 0.95
    """GefenMuonHybrid: GefenMuon's momentum."""
    nesterov: bool = True
    """GefenMuonHybrid: GefenMuon's Nesterov blend."""
    ns_steps: int = 5
    """GefenMuonHybrid: Newton-Schulz iterations (ns_schedule "standard" only)."""
    ns_schedule: str = "tuned3"
    """GefenMuonHybrid: gefen-x's named Newton-Schulz schedule ("standard",
    "tuned3", "tuned4"), given to GefenMuon as its ns_coefficients list."""
    adjust_lr_fn: str | None = "match_rms_adamw"
    """GefenMuonHybrid: GefenMuon's lr adjustment ("match_rms_adamw",
    "original", None)."""
    normuon: bool = True
    """GefenMuonHybrid: NorMuon's per-row second moment."""
    normuon_beta2: float = 0.95
    """GefenMuonHybrid: NorMuon's beta2."""
    normuon_eps: float = 1e-8
    """GefenMuonHybrid: NorMuon's eps."""

    def kwargs(self, config: Any = None) -> dict[str, Any]:
        """Its ``OPTION_KEYS``' values (the hybrid's groups are built from them: ``param_groups``)."""
        return {k: getattr(self, k) for k in OPTION_KEYS}

    def __post_init__(self) -> None:
        if self.backup_optimizer not in BACKUPS:
            raise ValueError(f"optimizer.hybrid.backup_optimizer must be 'gefen' or 'adamw', "
                             f"got {self.backup_optimizer!r}")


@dataclass(kw_only=True, slots=True)
class RoutedGroup(ParamGroupConfig):
    """A hybrid param group: which routed set it takes (its pattern is bound
    to the model parts' names by ``bind``)."""

    route: str
    """"muon" (the hidden matrices), "no_decay" (backup parameters whose FQN
    contains one of ``substrings``, case-insensitive) or "backup" (the rest)."""

    substrings: tuple[str, ...] = ()


def _blocks(model: nn.Module) -> nn.Module | None:
    for name, module in model.named_modules():
        if canonical_fqn(name) == BLOCKS:
            return module
    return None


def _hidden_matrices(model: nn.Module) -> set[int]:
    """ids of the parameters that go to GefenMuon (see the module docstring)."""
    blocks = _blocks(model)
    if blocks is None:
        return set()
    embeddings = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                  for p in m.parameters()}
    routers = {id(p) for m in blocks.modules() if isinstance(m, TokenChoiceTopKRouter) for p in m.parameters()}
    linears = {id(m.weight) for m in blocks.modules()
               if isinstance(m, nn.Linear) and m.weight is not None and m.weight.dim() == 2}
    experts = {id(p) for m in blocks.modules() if isinstance(m, GroupedExperts)
               for p in m.parameters(recurse=False) if p.dim() == 3}
    return (linears | experts) - embeddings - routers


def route(model: nn.Module) -> tuple[list[str], list[str]]:
    """(GefenMuon's, the backup's) trainable parameters of ``model`` by canonical FQN,
    in ``named_parameters`` order."""
    hidden = _hidden_matrices(model)
    muon, backup = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if id(p) in hidden else backup).append(canonical_fqn(name))
    return muon, backup


def param_groups(config: Any) -> list[ParamGroupConfig]:
    """The hybrid's groups for an ``[optimizer]`` config (``GefenOptimizersContainer.Config``),
    patterns unbound: GefenMuon's, then the backup's (no-decay first when
    ``no_decay_substrings`` is set)."""
    o, shorthand = config.hybrid.kwargs(), groups_of.shorthand(config)
    schedule = o["ns_schedule"]
    if schedule not in gx.ns_schedule_names():
        raise ValueError(f"optimizer.hybrid.ns_schedule must be one of {list(gx.ns_schedule_names())}, "
                         f"got {schedule!r}")
    muon = {
        "lr": shorthand["lr"] if o["muon_lr"] is None else o["muon_lr"],
        "weight_decay": shorthand["weight_decay"] if o["muon_weight_decay"] is None else o["muon_weight_decay"],
        "momentum": o["momentum"], "nesterov": o["nesterov"], "ns_steps": o["ns_steps"],
        "adjust_lr_fn": o["adjust_lr_fn"], "normuon": o["normuon"], "normuon_beta2": o["normuon_beta2"],
        "normuon_eps": o["normuon_eps"],
    }
    coefficients = gx.ns_schedule_coefficients(schedule)
    if coefficients is not None:  # as gefen-x: the schedule replaces the quintic, its length is the step count
        muon.update(ns_coefficients=coefficients, ns_steps=len(coefficients))
    backup_name = BACKUPS[o["backup_optimizer"]]
    backup = {
        "lr": shorthand["lr"] if o["backup_lr"] is None else o["backup_lr"],
        "betas": shorthand["betas"], "eps": shorthand["eps"],
        "weight_decay": shorthand["weight_decay"] if o["backup_weight_decay"] is None else o["backup_weight_decay"],
    }
    groups = [RoutedGroup(pattern="", optimizer_name="GefenMuon", optimizer_kwargs=muon, route="muon")]
    if o["no_decay_substrings"]:
        groups.append(RoutedGroup(pattern="", optimizer_name=backup_name, optimizer_kwargs={**backup,
                                  "weight_decay": 0.0}, route="no_decay",
                                  substrings=tuple(o["no_decay_substrings"])))
    groups.append(RoutedGroup(pattern=".*", optimizer_name=backup_name, optimizer_kwargs=backup, route="backup"))
    return groups


def check(config: Any) -> None:
    """Refuse hybrid keys (``OPTION_KEYS``) set to other than their defaults
    where they have no effect: another name, or explicit param_groups (which
    are used as they are)."""
    used = OPTION_KEYS if config.name == NAME and not config.param_groups else ()
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(HybridOptions)}
    unused = [k for k in OPTION_KEYS if k not in used and getattr(config.hybrid, k) != defaults[k]]
    if unused:
        why = ("[[optimizer.param_groups]] are given, and are used as they are" if config.param_groups
               else f"optimizer.name is {config.name!r}")
        raise ValueError(
            f"{', '.join('hybrid.' + k for k in unused)}: {'has' if len(unused) == 1 else 'have'} no effect: "
            f"{'it is a key' if len(unused) == 1 else 'they are keys'} of name = \"{NAME}\" without "
            f"param_groups, and {why}")
    if used:
        param_groups(config)  # its own checks (backup_optimizer, ns_schedule)


def _exact(names: list[str]) -> str:
    return "^(?:" + "|".join(re.escape(n) for n in names) + ")$"


def bind(groups: list[ParamGroupConfig], model_parts: list[nn.Module]) -> list[ParamGroupConfig]:
    """``groups`` (``param_groups``'s, keys as the container filled them in) with
    patterns matching exactly the parameter names each routed set has in the
    model parts. Raises when no model part has a hidden matrix."""
    muon: list[str] = []
    no_decay: list[str] = []
    grouped = expert_matrices = others = 0
    substrings = tuple(s.lower() for g in groups if isinstance(g, RoutedGroup) for s in g.substrings)
    for part in model_parts:
        hidden = _hidden_matrices(part)
        for name, p in part.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) in hidden:
                muon.append(name)
                if p.dim() == 3:
                    grouped, expert_matrices = grouped + 1, expert_matrices + p.shape[0]
            else:
                others += 1
                if substrings and any(s in canonical_fqn(name).lower() for s in substrings):
                    no_decay.append(name)
    if not muon:
        raise ValueError(
            f"optimizer.name = {NAME!r}: no hidden matrix to give GefenMuon (it takes the 2-D weights of the "
            f"nn.Linear modules inside the model's {BLOCKS!r} blocks, and this model has none); use "
            "[[optimizer.param_groups]] to choose its parameters")
    experts = (f", {grouped} of them MoE experts' grouped weights ({expert_matrices} expert matrices)"
               if grouped else "")
    logger.info(f"{NAME}: GefenMuon takes {len(muon)} parameters{experts}; the backup the other {others}")
    patterns = {"muon": _exact(muon), "no_decay": _exact(no_decay) if no_decay else None, "backup": ".*"}
    bound = []
    for g in groups:
        if not isinstance(g, RoutedGroup):
            bound.append(g)
            continue
        if patterns[g.route] is None:  # no parameter matches no_decay_substrings
            continue
        bound.append(dataclasses.replace(g, pattern=patterns[g.route]))
    return bound


def kind_hint(config: Any, was: str, now: str) -> str:
    """The setting that resumes parameters a checkpoint saved with optimizer
    ``was`` which this ``[optimizer]`` config gives to ``now``, where the
    hybrid explains it ("" where it does not)."""
    in_hybrid = config.name == NAME and not config.param_groups
    backup = {v: k for k, v in BACKUPS.items()}
    if in_hybrid and now != "GefenMuon" and was in backup:
        return (f"set optimizer.hybrid.backup_optimizer = \"{backup[was]}\" (--optimizer.hybrid.backup_optimizer "
                f"{backup[was]}), as in the run that wrote it")
    if not in_hybrid and was == "GefenMuon":
        return (f"if the run that wrote it was [optimizer] name = \"{NAME}\", set that (--optimizer.name {NAME}, "
                "and its hybrid.backup_optimizer)")
    if in_hybrid:
        return f"if the run that wrote it was not {NAME}, set its [optimizer] name (e.g. --optimizer.name {was})"
    return ""
