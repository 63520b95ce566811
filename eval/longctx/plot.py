"""Heat maps (length x depth) of a sweep summary, a side-by-side comparison, and compression vs length."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

SCORE_LABELS = {
    "string_match_all": "generation, string_match_all",
    "string_match_part": "generation, string_match_part",
    "loglik_acc": "log-likelihood ranking accuracy",
    "score": "score",
}


def grid(summary: dict, task: str, key: str) -> tuple[np.ndarray, list[str], list[str]]:
    """Matrix [lengths x depths] of `key` for one task (NaN where a cell was skipped or lacks the key)."""
    by_len = summary["results"].get(task, {})
    lengths = [str(n) for n in summary["config"]["lengths"]]
    depth_keys = sorted(
        {d for cells in by_len.values() for d in cells},
        key=lambda d: (d == "all", 0.0 if d == "all" else float(d)),
    )
    if not depth_keys:
        depth_keys = ["all"]
    mat = np.full((len(lengths), len(depth_keys)), np.nan)
    for i, n in enumerate(lengths):
        for j, d in enumerate(depth_keys):
            cell = by_len.get(n, {}).get(d)
            if cell is not None and key in cell:
                mat[i, j] = cell[key]
    return mat, lengths, depth_keys


def _draw(ax, mat, lengths, depths, title, cmap="RdYlGn", vmin=0.0, vmax=100.0, signed=False):
    cmap = matplotlib.colormaps[cmap].with_extremes(bad="#dddddd")  # skipped cells in grey
    im = ax.imshow(
        np.ma.masked_invalid(mat), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", origin="lower"
    )
    ax.set_xticks(range(len(depths)), [d if d == "all" else f"{d}%" for d in depths], fontsize=7)
    ax.set_yticks(range(len(lengths)), lengths, fontsize=7)
    ax.set_xlabel("needle depth" if depths != ["all"] else "(no needle)", fontsize=8)
    ax.set_ylabel("length (tokens)", fontsize=8)
    ax.set_title(title, fontsize=9)
    for i in range(mat.shape[0]):
        for j in range(mat.shape[1]):
            txt = (
                "skip"
                if math.isnan(mat[i, j])
                else (f"{mat[i, j]:+.0f}" if signed else f"{mat[i, j]:.0f}")
            )
            ax.text(j, i, txt, ha="center", va="center", fontsize=7)
    return im


def available_keys(summary: dict) -> list[str]:
    cells = [
        c
        for by_len in summary["results"].values()
        for by_d in by_len.values()
        for c in by_d.values()
    ]
    return [k for k in ("string_match_all", "loglik_acc") if any(k in c for c in cells)]


def plot_heatmaps(summary: dict, path: str | Path, key: str = "string_match_all") -> Path:
    tasks = list(summary["results"])
    cols = min(4, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False, layout="constrained"
    )
    im = None
    for ax, task in zip(axes.flat, tasks):
        im = _draw(ax, *grid(summary, task, key), task)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    title = f"{summary.get('label', '')}: {SCORE_LABELS.get(key, key)}"
    if key == "loglik_acc":
        title += f" (chance {100.0 / (1 + summary['config']['num_distractors']):.0f})"
    fig.suptitle(title, fontsize=10)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(a: dict, b: dict, path: str | Path, key: str = "string_match_all") -> Path:
    """One row per task: A, B and A - B (diverging colours)."""
    tasks = [t for t in a["results"] if t in b["results"]]
    fig, axes = plt.subplots(
        len(tasks), 3, figsize=(11, 2.8 * len(tasks)), squeeze=False, layout="constrained"
    )
    for row, task in zip(axes, tasks):
        ga, lengths, depths = grid(a, task, key)
        gb, lengths_b, depths_b = grid(b, task, key)
        _draw(row[0], ga, lengths, depths, f"{task}: {a.get('label', 'A')}")
        _draw(row[1], gb, lengths_b, depths_b, f"{task}: {b.get('label', 'B')}")
        diff = ga - gb if ga.shape == gb.shape else np.full_like(ga, np.nan)
        _draw(
            row[2],
            diff,
            lengths,
            depths,
            f"{task}: {a.get('label', 'A')} - {b.get('label', 'B')}",
            cmap="coolwarm",
            vmin=-100.0,
            vmax=100.0,
            signed=True,
        )
    fig.suptitle(SCORE_LABELS.get(key, key), fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_compression(summaries: list[dict], path: str | Path) -> Path | None:
    """Realized compression ratio per modality against length, one line per summary x modality."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    drew = False
    for s in summaries:
        comp = s.get("compression", {})
        lengths = [n for n in comp if comp[n]]
        keys = sorted({m for n in lengths for m in comp[n]})
        # the model's ratio keys; skip raw counts
        ratios = [k for k in keys if k.startswith("compression/")]
        for mod in ratios or keys:
            xs = [int(n) for n in lengths if mod in comp[n]]
            ax.plot(
                xs, [comp[str(x)][mod] for x in xs], marker="o", label=f"{s.get('label', '')} {mod}"
            )
            drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("tokens per concept")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
