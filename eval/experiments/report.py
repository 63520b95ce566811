"""One table printer, one plot and the claims table for every recipe (they read results.json's content only)."""

from __future__ import annotations

from pathlib import Path

from eval.experiments.core import Stat


def _stat(d: dict | None) -> Stat | None:
    return Stat(d["values"]) if d else None


def _label_columns(result: dict) -> list[str]:
    keys: list[str] = []
    for v in result["variants"]:
        keys += [k for k in v["labels"] if k not in keys]
    return keys


def format_table(result: dict) -> str:
    """The claim, what the columns mean, one line per variant (mean (min-max) over seeds), then the verdict."""
    labels = _label_columns(result)
    head = labels or ["variant"]
    metrics = result["metrics"]
    body = []
    for v in result["variants"]:
        cells = [v["labels"].get(k, "") for k in labels] if labels else [v["name"]]
        for m in metrics:
            s = _stat(result["table"][v["name"]].get(m["key"]))
            cells.append(s.fmt(m["digits"]) if s else "-")
        body.append(cells)
    header = head + [m["label"] for m in metrics]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    n_seeds = result["seeds"]
    out = [
        f"{result['recipe']} ({result['source']}): {result['claim']}",
        (
            f"({result['steps']} steps per run, {n_seeds} seed(s) each: "
            f"mean (min-max) over seeds; held-out = {result['held_out']})"
        ),
        line(header),
        line(["-" * w for w in widths]),
    ] + [line(r) for r in body]
    if result.get("note"):
        out.append(result["note"])
    out.append("")
    for c in result["checks"]:
        tag = "" if c["core"] else " [context]"
        out.append(f"- {c['claim']}{tag}: {c['status']}  ({c['measured']})")
    out.append(f"verdict: {result['verdict']}")
    return "\n".join(out)


def plot(result: dict, path: Path) -> Path:
    """One panel per metric: a bar per variant at the mean over seeds, min-max whiskers, one dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    metrics = result["metrics"]
    names = [v["name"] for v in result["variants"]]
    n = len(metrics)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.8 * rows), squeeze=False)
    x = np.arange(len(names))
    for ax, m in zip(axes.flat, metrics):
        stats = [_stat(result["table"][v].get(m["key"])) for v in names]
        mean = [s.mean if s else np.nan for s in stats]
        err = np.array([[s.mean - s.lo, s.hi - s.mean] if s else [0, 0] for s in stats]).T
        ax.bar(x, mean, 0.6, yerr=err, capsize=4, color="tab:blue", alpha=0.6)
        for i, s in enumerate(stats):
            if s:
                ax.plot([i] * s.n, s.values, "k.", ms=5)
        finite = [v for s in stats if s for v in s.values]
        if m.get("ref") is not None:
            ax.axhline(m["ref"], color="tab:red", lw=1, ls="--")
            finite.append(m["ref"])
        # e.g. compression ratios 1.3 to 500
        if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
            ax.set_yscale("log")
        elif finite:
            # zoom on the spread: differences between variants are often small next to the values
            lo, hi = min(finite), max(finite)
            pad = (hi - lo) * 0.3 or abs(hi) * 0.05 or 0.1
            ax.set_ylim(lo - pad if lo - pad > 0 or lo < 0 else 0, hi + pad)
        # long names side by side would overlap
        tilt = max(map(len, names)) > 12 and len(names) > 4
        ax.set_xticks(
            x,
            [nm.replace("-", "\n", 1) if len(nm) > 12 else nm for nm in names],
            fontsize=7,
            rotation=35 if tilt else 0,
            ha="right" if tilt else "center",
        )
        ax.set_title(m["label"], fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(
        f"{result['recipe']} ({result['steps']} steps, {result['seeds']} "
        f"seeds; bars: mean, whiskers: min-max): {result['verdict']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def claims_markdown(results: list[dict], skipped: dict[str, str] | None = None) -> str:
    """claim | measured | holds? : one line per core check of every recipe (context checks are left out)."""
    lines = ["| claim | measured | holds? |", "|---|---|---|"]
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    for r in results:
        for c in r["checks"]:
            if c["core"]:
                lines.append(
                    f"| **{r['recipe']}** ({r['source']}): {esc(c['claim'])} | {esc(c['measured'])} "
                    f"({r['steps']} steps x {r['seeds']} seeds) | {esc(c['status'])} |"
                )
    for name, why in (skipped or {}).items():
        lines.append(f"| **{name}** | not run: {esc(why)} | - |")
    return "\n".join(lines) + "\n"
