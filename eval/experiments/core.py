"""What a recipe is made of: variants (ordinary `vlm train` runs), the metrics read from each
finished run, the statistics over seeds, and the checks that turn those statistics into a verdict on
the paper's claim.

A check compares seed spreads (min..max over seeds), never single runs: "holds" needs the spreads to
be apart in the claimed direction, "does not hold" needs them apart the other way, and anything in
between (or a single seed) is "inconclusive". A claim that does not hold is reported as such, with
its numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HOLDS, FAILS, UNSURE = "holds", "does not hold at this scale", "inconclusive (seed spreads overlap)"
ONE_SEED = "inconclusive (one seed: no spread)"


@dataclass
class Metric:
    """One number per run; a table column and a plot panel."""

    key: str
    label: str
    digits: int = 3
    ref: float | None = None  # a reference value drawn across the panel (a target ratio, 1/R)


@dataclass
class Variant:
    """One `vlm train` run per seed: the recipe's config + the recipe's common overrides + these.

    `after`: a variant of the same seed that must finish first; "{run:NAME}" in an override is that
    variant's run directory (same seed). `ranks` > 1 launches through torch.distributed.run and
    takes that many job slots. `steps_mult` scales the recipe's steps for this variant (e.g. a
    pretraining source before continual training). `cost` scales the calibrated seconds per step in
    the time estimate (loops, a statistics pass), `extra_s` adds seconds outside the steps."""

    name: str
    overrides: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    after: str | None = None
    ranks: int = 1
    steps_mult: float = 1.0
    cost: float = 1.0
    extra_s: float = 0.0


@dataclass
class Stat:
    """A metric of one variant over its seeds."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def fmt(self, digits: int = 3) -> str:
        if self.n == 1:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ({self.lo:.{digits}f}-{self.hi:.{digits}f})"

    def to_json(self) -> dict:
        std = (
            (sum((v - self.mean) ** 2 for v in self.values) / (self.n - 1)) ** 0.5
            if self.n > 1
            else 0.0
        )
        return {
            "mean": self.mean,
            "min": self.lo,
            "max": self.hi,
            "std": std,
            "n": self.n,
            "values": self.values,
        }


class _Metrics(dict):
    def __missing__(self, key):  # a metric no run reported
        return None


class Table(dict):
    """variant -> metric key -> Stat. A variant that was not run (`--only`) or a metric no run
    reported reads as None, so that a check on it says "no numbers" instead of failing."""

    def __missing__(self, key):
        return _Metrics()


def stats_table(rows: list[dict], metrics: list[Metric], variants: list[str]) -> Table:
    """Group per-run rows (each with "variant") into per-variant statistics over seeds."""
    table = Table()
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        table[v] = _Metrics()
        for m in metrics:
            vals = [
                float(r[m.key])
                for r in mine
                if r.get(m.key) is not None and math.isfinite(float(r[m.key]))
            ]
            table[v][m.key] = Stat(vals) if vals else None
    return table


@dataclass
class Check:
    """One measurable part of a claim and how it came out. Non-core checks are context (printed, not voted)."""

    claim: str
    status: str
    measured: str
    core: bool = True

    def to_json(self) -> dict:
        return {
            "claim": self.claim,
            "status": self.status,
            "measured": self.measured,
            "core": self.core,
        }


def _missing(claim: str, core: bool, *names: str) -> Check:
    return Check(claim, f"inconclusive (no numbers for {', '.join(names)})", "-", core)


def better(
    claim: str,
    a: str,
    sa: Stat | None,
    b: str,
    sb: Stat | None,
    lower: bool = True,
    digits: int = 3,
    core: bool = True,
    what: str = "",
) -> Check:
    """`a` beats `b` (lower, or higher with lower=False): holds when the seed spreads are apart in
    a's favour, does not hold when they are apart the other way, inconclusive when they overlap."""
    if sa is None or sb is None:
        return _missing(claim, core, *(n for n, s in ((a, sa), (b, sb)) if s is None))
    if min(sa.n, sb.n) < 2:
        status = ONE_SEED
    elif (sa.hi < sb.lo) if lower else (sa.lo > sb.hi):
        # a's whole spread on the better side of b's
        status = HOLDS
    elif (sa.lo > sb.hi) if lower else (sa.hi < sb.lo):  # ... on the worse side
        status = FAILS
    else:
        status = UNSURE
    op = "<" if sa.mean < sb.mean else ">" if sa.mean > sb.mean else "="
    what = f"{what}: " if what else ""
    return Check(claim, status, f"{what}{a} {sa.fmt(digits)} {op} {b} {sb.fmt(digits)}", core)


def no_worse(
    claim: str,
    a: str,
    sa: Stat | None,
    b: str,
    sb: Stat | None,
    lower: bool = True,
    digits: int = 3,
    core: bool = True,
    what: str = "",
) -> Check:
    """`a` is no worse than `b`: does not hold when the spreads are apart against a; holds when a's
    mean is at least as good; inconclusive when a's mean is worse but the spreads overlap."""
    c = better(claim, a, sa, b, sb, lower, digits, core, what)
    if sa is None or sb is None or c.status in (FAILS, ONE_SEED):
        return c
    ok = sa.mean <= sb.mean if lower else sa.mean >= sb.mean
    c.status = HOLDS if ok else UNSURE
    return c


def at_most(
    claim: str,
    name: str,
    s: Stat | None,
    bound: float,
    digits: int = 3,
    core: bool = True,
    what: str = "",
) -> Check:
    """Every seed at or below `bound` holds; every seed above it does not; a spread across it is inconclusive."""
    if s is None:
        return _missing(claim, core, name)
    status = ONE_SEED if s.n < 2 else HOLDS if s.hi <= bound else FAILS if s.lo > bound else UNSURE
    what = f"{what}: " if what else ""
    return Check(claim, status, f"{what}{name} {s.fmt(digits)} vs bound {bound:g}", core)


def overall(checks: list[Check]) -> str:
    """The recipe's verdict from its core checks: all hold -> holds; any does not hold -> does not hold."""
    core = [c.status for c in checks if c.core]
    if core and all(s == HOLDS for s in core):
        return HOLDS
    if any(s == FAILS for s in core):
        return FAILS
    return next((s for s in core if s != HOLDS), UNSURE)  # the first open check says why


class Run:
    """A finished run directory as the metric readers see it: summary.json, metrics.jsonl, config.yaml."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.summary = json.loads((self.path / "summary.json").read_text())
        from vlm.train.metrics_sinks import read_metrics  # torch: not for `vlm --help`

        self.records = read_metrics(self.path / "metrics.jsonl")

    def values(self, key: str) -> list[float]:
        return [r[key] for r in self.records if r.get(key) is not None]

    def first(self, key: str) -> float | None:
        """The first logged step's value: for losses, the model as it started (step 1's forward)."""
        vals = self.values(key)
        return vals[0] if vals else None

    def tail(self, key: str, frac: float = 0.1) -> float | None:
        """Mean over the last `frac` of the logged steps (training-side numbers are noisy step to step)."""
        vals = self.values(key)
        if not vals:
            return None
        n = max(int(len(vals) * frac), 1)
        return sum(vals[-n:]) / n

    def last_val(self, key: str) -> float | None:
        """The last held-out evaluation's `val/KEY` (the trainer evaluates at the final step)."""
        vals = self.values(f"val/{key}")
        return vals[-1] if vals else None

    def config(self) -> dict:
        import yaml

        return yaml.safe_load((self.path / "config.yaml").read_text())


# (this run, the same seed's runs by variant) -> row
MetricsFn = Callable[[Run, dict[str, Run]], dict]
VerdictFn = Callable[[Table], list[Check]]


@dataclass
class Recipe:
    """Variants trained side by side with everything else equal, over seeds, and how to judge the claim."""

    name: str
    source: str  # where the claim is made, e.g. "ConceptMoE 4.5.2"
    claim: str  # the claim, as this recipe tests it
    config: str  # base YAML under configs/
    variants: list[Variant]
    metrics: list[Metric]
    read: MetricsFn  # one table row from a finished run
    verdict: VerdictFn
    # default optimizer steps per variant (times the variant's steps_mult)
    steps: int
    held_out: str  # what "held-out" means in this recipe's table
    seeds: int = 2
    common: list[str] = field(default_factory=list)
    evals: int = 4  # held-out evaluations per run (the last is at the final step)
    # calibrated on the 2-core machine (text config, two runs side by side, other work present):
    # seconds per step of one run, and per run outside the steps (process start, DeepSpeed, data,
    # final export, summary)
    step_s: float = 0.13
    startup_s: float = 20.0
    note: str = ""  # printed under the table


def configs_dir() -> Path:
    import configs

    return Path(configs.__file__).resolve().parent
