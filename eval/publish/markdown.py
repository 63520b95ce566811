"""Markdown tables and number formats shared by the renderers."""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub table: the header, `| --- |` separators, one line per row."""

    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(row) for row in rows)])


def num(x: float, decimals: int) -> str:
    return f"{x:.{decimals}f}"


def cell(value: Any, decimals: int | None) -> str:
    """A recorded cell: a string as written; a number with the table's decimals; a list of numbers
    joined by ' / ' (one per seed or per variant)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or decimals is None:
        raise ValueError(f"recorded cell {value!r}: numbers need the table's `decimals`")
    if isinstance(value, (int, float)):
        return num(value, decimals)
    if isinstance(value, list):
        return " / ".join(cell(v, decimals) for v in value)
    raise ValueError(f"recorded cell {value!r}: a string, a number or a list of numbers")


def span(values: Iterable[float], decimals: int, sep: str = "-") -> str:
    """'lo-hi' of the values at `decimals`, one figure where both round alike."""
    vals = sorted(values)
    lo, hi = num(vals[0], decimals), num(vals[-1], decimals)
    return lo if lo == hi else f"{lo}{sep}{hi}"
