"""Plain-text pieces of the offline tools' reports (tables, shapes, numbers), shared by ``ckpt inspect``
and the kinds' own rows (``checkpoint.format.kinds.KindDescription.render``), which sit below the tools."""

from __future__ import annotations

from typing import Any

__all__ = ["count", "shape", "value", "hyper_line", "codebook_line", "table"]


def count(x: int | None) -> str:
    return "?" if x is None else f"{x:,}"


def shape(s) -> str:
    return "x".join(str(v) for v in s) if s else "scalar"


def value(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float, list, tuple)):
        return str(v)
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(value(x) for x in v) + ")"
    return f"{v:g}"


def hyper_line(g: dict) -> str:
    """A param group's hyperparameters, ``key value`` pairs."""
    return "  ".join(f"{k} {value(v)}" for k, v in g.items())


def codebook_line(name: str, cb: dict) -> str:
    if cb["smallest_positive"] is None or cb["largest_negative"] is None:
        return f"  codebook {name}: {cb['entries']} entries ({cb['distinct']} distinct)"
    return (f"  codebook {name}: {cb['entries']} entries ({cb['distinct']} distinct), [{cb['min']:g}, {cb['max']:g}], "
            f"nearest zero {cb['largest_negative']:.3g} / {cb['smallest_positive']:.3g}")


def table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        cols = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return (indent + "  ".join(cols)).rstrip()

    return [line(header)] + [line(r) for r in rows]
