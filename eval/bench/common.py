"""The suite's one measurement method, and its output (JSON, a printed table, a matplotlib figure).

Method: every candidate is called `warmup` times first (allocator, caches, lazy initialisation),
then in each of `repeats` rounds the baseline and every candidate run once each, in an order rotated
from round to round, so that whatever else happens on the machine (another job, frequency changes)
hits all candidates alike instead of the one that happened to run then. A candidate's figure is the
median over rounds with its spread (min, max, quartiles); its ratio is its median over the
baseline's median. A first call or a mean of a few calls is never reported.

A result is a dict: `part`, `machine`, `settings`, `rows` (one per candidate and setting:
`candidate`, `setting`, `metric`, `unit`, `median`, `spread`, `n`, `ratio_vs_baseline`, plus the
part's own fields) and optional `notes` (printed under the table) and `unavailable` (candidates that
could not run here, and why).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OPERATORS_METRIC = "operators per step (CPU, non-view aten ops)"
# Ops that run no kernel: they alias or wrap a tensor's storage, or read a scalar back (a sync, not
# a launch).
_NO_KERNEL = (
    torch.ops.aten.detach,
    torch.ops.aten.alias,
    torch.ops.aten.lift_fresh,
    torch.ops.aten._local_scalar_dense,
)


def machine() -> dict:
    """What the figures were measured on: they mean nothing without it. Every part runs on CPU tensors."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "device": "cpu",
        "cuda_available": torch.cuda.is_available(),
    }


def _call(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    got = fn()
    elapsed = time.perf_counter() - t0
    # A candidate whose call includes untimed setup (refilling a cache, starting worker processes)
    # times its own measured part and returns that as a float.
    return got if isinstance(got, float) else elapsed


def measure(
    candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of every candidate over `repeats` interleaved rounds (the first name is the baseline)."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            _call(candidates[name])
    seconds = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            seconds[name].append(_call(candidates[name]))
    return seconds


class _OperatorCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket not in _NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_operators(fn: Callable[[], object]) -> int:
    """The operators `fn()` dispatches (its backward and optimizer step included when it runs them):
    the project's CPU proxy for kernel launches (OPERATORS_METRIC). A dispatch mode sees the ops
    below autograd and past the composite ops' decompositions, which is what a backend runs as
    kernels; views and metadata-only ops launch nothing and are not counted. `fn` must run eagerly:
    Dynamo refuses to run compiled code under a dispatch mode."""
    with _OperatorCounter() as counter:
        fn()
    return counter.count


def summary(values: list[float]) -> dict:
    """Median, spread and count of one candidate's per-round values."""
    v = sorted(values)
    q1, _, q3 = (
        statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0], v[0], v[0])
    )
    return {
        "median": statistics.median(v),
        "spread": {"min": v[0], "max": v[-1], "q1": q1, "q3": q3},
        "n": len(v),
    }


def rows(
    values: dict[str, list[float]],
    baseline: str,
    setting: dict,
    metric: str,
    unit: str,
    extra: dict[str, dict] | None = None,
) -> list[dict]:
    """One row per candidate from its per-round values (already in the metric's unit)."""
    base = statistics.median(values[baseline])
    out = []
    for name, v in values.items():
        s = summary(v)
        out.append(
            {
                "candidate": name,
                "setting": dict(setting),
                "metric": metric,
                "unit": unit,
                **s,
                "ratio_vs_baseline": s["median"] / base if base else float("nan"),
                **(extra or {}).get(name, {}),
            }
        )
    return out


def per_second(
    seconds: dict[str, list[float]], work: float | dict[str, float]
) -> dict[str, list[float]]:
    """Throughput (work units per second) of every round: `work` per call, one figure or one per candidate."""
    return {
        n: [(work[n] if isinstance(work, dict) else work) / t for t in ts]
        for n, ts in seconds.items()
    }


def result(part: str, settings: dict, rows_: list[dict], **more) -> dict:
    return {"part": part, "machine": machine(), "settings": settings, "rows": rows_, **more}


def write_json(res: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{res['part']}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    return path


# ----------------------------------------------------------------------------- the printed table


def _fmt(x) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        a = abs(x)
        return f"{x:.3g}" if a < 10 else f"{x:,.0f}"
    return str(x)


def table(res: dict) -> str:
    """The rows as text, grouped by setting, with each row's own extra fields after the fixed columns."""
    fixed = {"candidate", "setting", "metric", "unit", "median", "spread", "n", "ratio_vs_baseline"}
    m = res["machine"]
    lines = [
        (
            f"== {res['part']} ==  ({m['device']}, {m['threads']} threads, torch {m['torch']}; "
            "median [min-max] over interleaved rounds; ratio = median / baseline's median)"
        )
    ]
    width = max([len(r["candidate"]) for r in res["rows"]] + [9])
    last = None
    for r in res["rows"]:
        key = (tuple(sorted(r["setting"].items())), r["metric"])
        if key != last:
            lines.append(
                "  " + ", ".join(f"{k}={v}" for k, v in r["setting"].items()) + f"  [{r['metric']}]"
            )
            last = key
        sp = r["spread"]
        rng = f"[{_fmt(sp['min'])}-{_fmt(sp['max'])}]" if sp else ""
        extra = "  ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k not in fixed)
        lines.append(
            f"    {r['candidate']:<{width}} {_fmt(r['median']):>9} "
            f"{r['unit']:<8} {rng:<22} x{r['ratio_vs_baseline']:.2f}  {extra}".rstrip()
        )
    for note in res.get("notes", []):
        lines.append(f"  note: {note}")
    for name, why in res.get("unavailable", {}).items():
        lines.append(f"  unavailable: {name}: {why}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the figure


def plot(
    res: dict,
    path: str | Path,
    x: str,
    panels: tuple[str, ...] = (),
    y: str = "ratio_vs_baseline",
    ylabel: str = "ratio to the baseline's median",
    logx: bool = True,
    logy: bool = False,
    title: str = "",
    hlines: list[tuple[float, str]] = (),
) -> Path:
    """One panel per distinct value of the `panels` keys (setting fields or `metric`), one line per
    candidate: `y` (a row field) against the setting field `x`, with the min-max spread as a band
    when y is the median; `hlines` are (y, label) reference lines drawn in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def field(r, k):
        return r["metric"] if k == "metric" else r["setting"][k]

    groups = list(dict.fromkeys(tuple(field(r, k) for k in panels) for r in res["rows"]))
    colour = {
        n: f"C{i % 10}" for i, n in enumerate(dict.fromkeys(r["candidate"] for r in res["rows"]))
    }
    fig, axes = plt.subplots(1, len(groups), figsize=(4.8 * len(groups), 3.6), squeeze=False)
    for ax, g in zip(axes[0], groups):
        rs = [r for r in res["rows"] if tuple(field(r, k) for k in panels) == g]
        for name in dict.fromkeys(r["candidate"] for r in rs):
            pts = sorted(
                ((r["setting"][x], r) for r in rs if r["candidate"] == name), key=lambda p: p[0]
            )
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1][y] for p in pts], marker="o", label=name, color=colour[name])
            if y == "median" and all(p[1]["spread"] for p in pts):
                ax.fill_between(
                    xs,
                    [p[1]["spread"]["min"] for p in pts],
                    [p[1]["spread"]["max"] for p in pts],
                    color=colour[name],
                    alpha=0.2,
                )
        if logx and len({r["setting"][x] for r in rs}) > 1:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        if y == "ratio_vs_baseline":
            ax.axhline(1.0, color="grey", lw=0.8)
        for value, label in hlines:
            ax.axhline(value, color="black", ls="--", lw=0.8, label=label)
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel if y != "median" else f"{rs[0]['metric']} ({rs[0]['unit']})")
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(panels, g)), fontsize=9)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
