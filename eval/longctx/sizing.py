"""Size a sample to a target token count with the model's own tokenizer (RULER's binary search).

`build(n)` must be a deterministic function of the haystack size `n` (all random choices drawn
beforehand), and its token count must not shrink as `n` grows. We search for the largest `n` whose
prompt fits in `target` tokens, then require the result to be within `tol` below the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

LENGTH_TOLERANCE = 0.02


class SizingError(ValueError):
    """The target length cannot be met (too short for the task's fixed text, or too coarse)."""


@dataclass
class Fitted(Generic[T]):
    item: T
    n: int
    length: int


def fit_to_length(
    build: Callable[[int], T],
    measure: Callable[[T], int],
    target: int,
    *,
    what: str = "sample",
    n_max: int | None = None,
    tol: float = LENGTH_TOLERANCE,
) -> Fitted[T]:
    """Largest haystack size n with measure(build(n)) <= target; error unless >= (1 - tol) * target."""
    if target <= 0:
        raise SizingError(f"{what}: target length must be positive, got {target}")
    cache: dict[int, tuple[T, int]] = {}

    def length_of(n: int) -> int:
        if n not in cache:
            item = build(n)
            cache[n] = (item, measure(item))
        return cache[n][1]

    base = length_of(0)
    if base > target:
        raise SizingError(
            f"{what}: the prompt without any haystack is already "
            f"{base} tokens, longer than the target {target}"
        )
    # exponential search for an upper bound, starting from a per-token guess
    lo = 0
    per_unit = max(1, length_of(1) - base)
    hi = max(1, int((target - base) / per_unit))
    while length_of(hi) <= target:
        lo = hi
        if n_max is not None and hi >= n_max:
            break
        hi = hi * 2 if n_max is None else min(hi * 2, n_max)
    if length_of(hi) <= target:
        lo = hi
    else:
        while hi - lo > 1:  # invariant: length(lo) <= target < length(hi)
            mid = (lo + hi) // 2
            if length_of(mid) <= target:
                lo = mid
            else:
                hi = mid
    item, length = cache[lo]
    if length < (1.0 - tol) * target:
        limit = f" (haystack capped at {n_max} units)" if n_max is not None and lo >= n_max else ""
        raise SizingError(
            f"{what}: best fit is {length} tokens for target {target}{limit}; outside "
            f"the {tol:.0%} tolerance (one haystack unit adds ~{per_unit} tokens)"
        )
    return Fitted(item=item, n=lo, length=length)
