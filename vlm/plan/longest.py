"""The longest row one rank trains in a GPU of G GiB: `longest_row`.

A plan's peak grows with the row through the activations (and the vision tower's images) and is
otherwise the model states, which do not depend on it: peak(T) = a + b T. Two plans at short rows
give a and b; the row where the fitting rule (vlm.plan.plan: peak x 1.10 + the CUDA reserve <= G)
is met exactly, rounded down to the row granularity, is then planned itself and stepped down
until its plan fits (attention and the concept capacity grow a little faster than linearly), and
the next granule is planned to show it does not. Every row is planned with one row per
micro-batch, split over parallel.sequence ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from configs.config import ConfigError

GRANULE = 1024  # rows are multiples of this many tokens per sequence rank
PROBES = (8, 32)  # the two probes' rows, in granules per sequence rank
MAX_TRIES = 8


@dataclass
class LongestRow:
    row_tokens: int  # 0: not even the shortest row fits
    plan: object | None  # the plan at row_tokens (the shortest row's where none fits)
    fit: tuple[float, float]  # a (bytes) and b (bytes per token of the row) of the peak's line
    tried: list[tuple[int, float, bool]]  # (row, planned GiB, fits), in the order planned

    def as_dict(self) -> dict:
        return {
            "longest_row_tokens": self.row_tokens,
            "peak_line": {"bytes": round(self.fit[0]), "bytes_per_token": round(self.fit[1], 1)},
            "tried": [
                {"row_tokens": t, "per_rank_gb": round(g, 3), "fits": f} for t, g, f in self.tried
            ],
            "plan": None if self.plan is None else self.plan.as_dict(),
        }


def _backward_peak(plan) -> float:
    """The moment that grows with the row (the others are model states alone)."""
    return float(plan.moments["backward"])


def longest_row(
    config: str, ranks: int, overrides: list[str], gpu_memory_gb: float, **kw
) -> LongestRow:
    """The longest `data.row_tokens` (one row per micro-batch) whose plan fits `gpu_memory_gb`; `kw`
    as for vlm.plan.plan.make_plan. ConfigError: one line."""
    from vlm.plan.config import load_plan_config
    from vlm.plan.plan import FRAGMENTATION, GiB, make_plan

    fixed = [
        o for o in overrides if o.split("=", 1)[0] not in ("data.row_tokens", "data.rows_per_batch")
    ]
    S = load_plan_config(config, list(fixed), ranks).layout.sequence
    step = GRANULE * S
    tried: list[tuple[int, float, bool]] = []
    plans: dict[int, object] = {}

    def plan_at(T: int):
        if T in plans:
            return plans[T]
        p = plans[T] = make_plan(
            config,
            ranks,
            [*fixed, f"data.row_tokens={T}", "data.rows_per_batch=1"],
            gpu_memory_gb=gpu_memory_gb,
            **kw,
        )
        tried.append((T, p.per_rank_gb, bool(p.fits)))
        return p

    (t1, p1), (t2, p2) = ((g * step, plan_at(g * step)) for g in PROBES)
    b = (_backward_peak(p2) - _backward_peak(p1)) / (t2 - t1)
    a = _backward_peak(p1) - b * t1
    if b <= 0:
        raise ConfigError(
            f"{config}: the planned peak does not grow with the row; nothing to search"
        )
    budget = (gpu_memory_gb - p1.reserved_gb) / (1 + FRAGMENTATION) * GiB
    # the other moments (the reduction, the optimizer step) bound the peak from below at any row
    floor = max(v for k, v in p1.moments.items() if k != "backward")
    if floor > budget:
        return LongestRow(0, p1, (a, b), tried)
    T = int((budget - a) / b) // step * step
    best = None
    for _ in range(MAX_TRIES):  # down from the line's row until a plan fits
        if T < step:
            break
        p = plan_at(T)
        if p.fits:
            best = (T, p)
            break
        T -= step * max(1, T // step // 50)  # about 2 % a try
    if best is None:
        return LongestRow(0, p1, (a, b), tried)
    for _ in range(MAX_TRIES):  # and up, one granule at a time, until the next does not
        p = plan_at(best[0] + step)
        if not p.fits:
            break
        best = (best[0] + step, p)
    return LongestRow(best[0], best[1], (a, b), tried)
