"""argparse types that refuse a bad value when the command line is parsed, in one line (argparse
prints it and exits 2), instead of failing later, turn by turn or after the work: counts,
temperatures, ports, sizes. Shared by the `vlm` commands of every layer."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole_number(
    unit: str = "", low: int = 1, high: int | None = None, what: str | None = None
) -> Callable[[str], int]:
    """An int in [low, high] (no upper bound when None): "a whole number of `unit`", or `what` when given."""
    what = what or (f"a whole number of {unit}" if unit else "a whole number")
    bound = f"{low}-{high}" if high is not None else f">= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {value}")
        return value

    return parse


def finite_number(
    what: str, low: float, strict: bool = False, note: str = ""
) -> Callable[[str], float]:
    """A finite float >= low (> low when `strict`), described as `what` (and `note`, e.g. "(0: greedy)")."""
    bound = f"{'>' if strict else '>='} {low:g}" + (f" {note}" if note else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text}")
        return value

    return parse
