"""The two sides of a validated pair: a process count, and optionally the parallelism of that run.

A pair is ``SIDE:SIDE`` (``--pairs 2:4,2@ep2:1``; ``--from SIDE --to SIDE``)::

    SIDE   = N | N@LAYOUT          N processes
    LAYOUT = DEGREE[xDEGREE...]     e.g. ep2, tp2, 4@ep2xtp2, 8@rep2xfsdp2xtp2
    DEGREE = NAME K                 K >= 1; NAME one of DEGREES' keys

A bare ``N`` keeps the recipe's own degrees (TP, PP, CP, replicate, EP, as
the recipe and ``--set`` give them) and the data-parallel shard degree takes
what they leave of N: what every pair was before layouts existed, so
``recipes/llama_gefen_tp2.toml`` at ``2`` is still TP 2. ``N@LAYOUT``
names the whole layout of that run: a degree it does not name is 1 whatever
the recipe says, and the shard degree (``fsdp``) takes what the others leave
of N (naming it only checks it). So one validation can save under one
parallelism and resume under another (``2@ep2:2`` is EP 2 -> EP 1 on 2
ranks, ``2:2@tp2`` FSDP 2 -> TP 2), which a ``--set`` (every run alike)
cannot say.

What the degrees alone decide is checked here, before any run
(``LayoutError`` naming the side): the syntax, degrees that do not divide N,
EP that does not divide the ranks it borrows (torchtitan: efsdp = fsdp * cp
* tp / ep). With the side's built config, the recipe layer checks the mesh
and EP against the model (``recipe.checks.validate_mesh``: experts that EP
does not split, EP on a model without experts) and ``config_problems`` what
else the model cannot take (TP not dividing the attention heads, more
pipeline stages than layers); ``preflight`` runs both.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["DEGREES", "LayoutError", "Side", "as_side", "config_problems", "cuda_graph_flags", "degree_flags",
           "degree_keys", "parse_pairs", "parse_side", "recipe_degrees", "strip_degree_flags"]

# Layout names -> torchtitan's ParallelismConfig fields, in the order a label
# lists them (torchtitan's mesh order: pp, dp_replicate, dp_shard, cp, tp; EP last).
DEGREES = {
    "pp": "pipeline_parallel_degree",
    "rep": "data_parallel_replicate_degree",
    "fsdp": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "ep": "expert_parallel_degree",
}
SHARD = "fsdp"
# The degrees whose product with the shard degree is the world size. EP adds
# no ranks: it borrows them from fsdp * cp * tp (torchtitan's ParallelismConfig).
WORLD = ("pp", "rep", "cp", "tp")
BORROWED_BY_EP = ("fsdp", "cp", "tp")
_TOKEN = re.compile(r"([a-z]+)(\d+)")


class LayoutError(ValueError):
    """A pair or side that no run can take; the message names it and says what to write."""


def degree_keys() -> tuple[str, ...]:
    """torchtitan's ``--parallelism.*`` field of every layout degree."""
    return tuple(DEGREES.values())


@dataclass(frozen=True)
class Side:
    """One side of a pair: ``nproc`` processes; ``layout`` the named degrees
    > 1 other than the shard degree (sorted as ``DEGREES``), or None for the
    recipe's own degrees (a bare ``N``)."""

    nproc: int
    layout: tuple[tuple[str, int], ...] | None = None

    @property
    def plain(self) -> bool:
        return self.layout is None

    @property
    def label(self) -> str:
        """``2`` (recipe's degrees), ``2@ep2``, ``4@tp2xep2``; pure data
        parallelism named explicitly is ``N@fsdpN``."""
        if self.layout is None:
            return str(self.nproc)
        if not self.layout:
            return f"{self.nproc}@{SHARD}{self.nproc}"
        return f"{self.nproc}@" + "x".join(f"{name}{k}" for name, k in self.layout)

    @property
    def key(self) -> int | str:
        """How the report names the side: the process count for a bare
        ``N`` (as every report before layouts did), else the label."""
        return self.nproc if self.layout is None else self.label

    def sort_key(self) -> tuple[int, int, str]:
        return (self.nproc, 0 if self.layout is None else 1, self.label)

    def ranks(self) -> str:
        """``2 rank(s)`` for a bare side, ``2@tp2`` otherwise (the log's and the messages' name)."""
        return f"{self.nproc} rank(s)" if self.layout is None else self.label

    def degrees(self, recipe: dict[str, int]) -> dict[str, int]:
        """Every layout degree of this side's runs (``DEGREES``' names).

        ``recipe``: the recipe's own degrees (``recipe_degrees``), used by a
        bare side only. The shard degree is what the others leave of N.
        Raises LayoutError when they do not divide N.
        """
        named = dict(self.layout or ()) if self.layout is not None else \
            {n: max(1, int(recipe.get(n, 1))) for n in DEGREES if n != SHARD}
        out = {n: named.get(n, 1) for n in DEGREES}
        others = math.prod(out[n] for n in WORLD)
        if self.nproc % others:
            where = "the recipe's degrees" if self.layout is None else "its degrees"
            raise LayoutError(f"{self.label}: {where} ({_listing(out)}) do not divide {self.nproc} processes")
        out[SHARD] = self.nproc // others
        borrowed = math.prod(out[n] for n in BORROWED_BY_EP)
        if borrowed % out["ep"]:
            raise LayoutError(f"{self.label}: ep {out['ep']} does not divide fsdp x cp x tp = {borrowed}, the ranks "
                              "expert parallelism borrows (torchtitan: efsdp = fsdp * cp * tp / ep)")
        return out


def _listing(degrees: dict[str, int]) -> str:
    """``tp 2``, ``pp 2 x tp 2 = 4``: the degrees that multiply to the world size."""
    named = [(n, degrees[n]) for n in WORLD if degrees.get(n, 1) > 1]
    text = " x ".join(f"{n} {k}" for n, k in named)
    return text if len(named) == 1 else f"{text} = {math.prod(k for _, k in named)}"


def as_side(side: Side | int) -> Side:
    """A bare process count as the side it stands for."""
    return side if isinstance(side, Side) else Side(int(side))


def parse_side(text: str) -> Side:
    """``"2"``, ``"2@ep2"``, ``"4@ep2xtp2"`` as a Side (LayoutError naming the bad part)."""
    text = text.strip()
    count, at, layout = text.partition("@")
    if not count.isdigit() or int(count) < 1:
        raise LayoutError(f"{text!r}: a side is N or N@LAYOUT with N >= 1 processes (e.g. 2, 2@ep2, 4@ep2xtp2)")
    nproc = int(count)
    if not at:
        return Side(nproc)
    if not layout:
        raise LayoutError(f"{text!r}: nothing after '@': name degrees joined by 'x', e.g. {nproc}@tp2 "
                          f"({', '.join(DEGREES)})")
    named: dict[str, int] = {}
    for token in layout.split("x"):
        m = _TOKEN.fullmatch(token)
        if not m or m.group(1) not in DEGREES:
            raise LayoutError(f"{text!r}: {token!r} is not a degree: write NAME K with NAME one of "
                              f"{', '.join(DEGREES)} (e.g. ep2), joined by 'x'")
        name, k = m.group(1), int(m.group(2))
        if name in named:
            raise LayoutError(f"{text!r}: {name} is named twice")
        if k < 1:
            raise LayoutError(f"{text!r}: {token}: a degree is >= 1")
        named[name] = k
    others = math.prod(named.get(n, 1) for n in WORLD)
    if nproc % others:
        raise LayoutError(f"{text!r}: {_listing(named)} does not divide {nproc} processes")
    shard = nproc // others
    if named.get(SHARD, shard) != shard:
        raise LayoutError(f"{text!r}: fsdp {named[SHARD]} does not fill {nproc} processes: the other degrees "
                          f"leave fsdp {shard} (or leave fsdp out: it takes what the others leave)")
    side = Side(nproc, tuple((n, named[n]) for n in DEGREES if n != SHARD and named.get(n, 1) > 1))
    try:
        side.degrees({})  # EP's borrowing
    except LayoutError as e:
        raise LayoutError(f"{text!r}: {str(e).partition(': ')[2]}") from None
    return side


def parse_pairs(pairs: str | None, source: str | int | None = None,
                target: str | int | None = None) -> list[tuple[Side, Side]]:
    """``"2:4,2@ep2:1"`` (or one ``source``/``target``) as sides. LayoutError
    names the pair and the side that is wrong."""
    items: list[tuple[str, str, str]] = []
    if pairs:
        for item in pairs.split(","):
            a, colon, b = item.strip().partition(":")
            if not colon or ":" in b:
                raise LayoutError(f"pair {item.strip()!r}: expected SIDE:SIDE, e.g. 2:4 or 2@ep2:1")
            items.append((item.strip(), a, b))
    elif source is None or target is None:
        raise LayoutError("give --from SIDE --to SIDE, or --pairs SIDE:SIDE,... (a side: N or N@LAYOUT)")
    else:
        items.append((f"{source}:{target}", str(source), str(target)))
    out = []
    for item, a, b in items:
        sides = []
        for which, text in (("source", a), ("target", b)):
            try:
                sides.append(parse_side(text))
            except LayoutError as e:
                raise LayoutError(f"pair {item!r}, {which} side: {e}") from None
        out.append((sides[0], sides[1]))
    return out


def strip_degree_flags(flags: list[str]) -> tuple[list[str], list[str]]:
    """``flags`` less every ``--parallelism.<degree> V`` (or ``=V``), and
    the degree fields they named."""
    keys = set(degree_keys())
    out, named, i = [], [], 0
    while i < len(flags):
        name, eq, _ = flags[i].partition("=")
        section, _, key = name[2:].replace("-", "_").partition(".")
        if flags[i].startswith("--") and section == "parallelism" and key in keys:
            named.append(key)
            i += 1 if eq else 2
            continue
        out.append(flags[i])
        i += 1
    return out, named


def recipe_degrees(parallelism: Any) -> dict[str, int]:
    """A built config's degrees (``parallelism``: torchtitan's ParallelismConfig), by layout name."""
    return {name: int(getattr(parallelism, key)) for name, key in DEGREES.items()}


def degree_flags(side: Side, degrees: dict[str, int]) -> list[str]:
    """The ``--parallelism.*`` flags of one side's runs.

    A bare side gets the shard degree only (as every run before layouts:
    the recipe's other degrees stand); a side with a layout gets every
    degree, so the recipe's own (``llama_gefen_tp2.toml``'s TP 2) cannot
    leak into it.
    """
    names = [SHARD] if side.plain else list(DEGREES)
    return [a for n in names for a in (f"--parallelism.{DEGREES[n]}", str(degrees[n]))]


def cuda_graph_flags(degrees: dict[str, int], disabled: bool) -> list[str]:
    """``--training.disable_cuda_graphs true`` where torchtitan refuses the
    side without it (EP > 1 or PP > 1: its ``_validate_cuda_graphs``, on
    CPU too) and the recipe has not set it (``disabled``).

    Added per side, not to every run: the flag changes nothing on CPU and,
    on CUDA, only whether the step is captured as a graph (same kernels) and
    ``zero_grad(set_to_none=...)``, both outside the arithmetic of the step.
    So a bare side stays the recipe's own run (and its reference-cache entry).
    """
    if disabled or (degrees["ep"] == 1 and degrees["pp"] == 1):
        return []
    return ["--training.disable_cuda_graphs", "true"]


def _configs(config: Any) -> list[Any]:
    """Every dataclass in a model config's tree (lists of layers included)."""
    out, todo, seen = [], [config], set()
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        if isinstance(c, (list, tuple)):
            todo.extend(c)
        elif dataclasses.is_dataclass(c) and not isinstance(c, type):
            out.append(c)
            todo.extend(getattr(c, f.name) for f in dataclasses.fields(c))
    return out


def config_problems(config: Any, degrees: dict[str, int]) -> list[str]:
    """What the model of a built config cannot take at these degrees
    (torchtitan would fail on some ranks at the model's parallelization).
    EP against the experts is the recipe layer's (``validate_mesh``)."""
    model = config.model_spec.model if config.model_spec is not None else None
    if model is None:
        return []
    problems = []
    tp, pp = degrees["tp"], degrees["pp"]
    if tp > 1:
        heads = {(name, value) for c in _configs(model) for name in ("n_heads", "n_kv_heads")
                 if isinstance(value := getattr(c, name, None), int) and value > 0}
        for name, value in sorted(heads):
            if value % tp:
                problems.append(f"tp {tp} does not divide the model's {name} = {value}")
    layers = getattr(model, "layers", None)
    if pp > 1 and layers is not None and len(layers) < pp:
        problems.append(f"pp {pp}: the model has {len(layers)} layers, fewer than the stages")
    return problems
