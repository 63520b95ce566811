"""`vlm experiment NAME [--out DIR] [--steps N] [--jobs J]`: a recipe trains small variants side by side
(everything else equal) and prints one table, written as JSON and drawn.

Each variant is an ordinary `vlm train` run on the default config with a few dotted overrides, so every
number in the table can be reproduced (and inspected: metrics, dashboard, report) from its run directory.
Runs go `--jobs` at a time, one torch thread each.

Recipes:
- image-compression: does the VLM see, and how hard are images compressed? frozen-at-random vs trained vision
  encoder x joint compression target vs per-modality targets x 2D-aware boundaries off/on -> held-out VQA
  accuracy against the blind model and the majority answer, and the realized ratio per modality in training
  and on the held-out split (ConceptMoE Figure 2c: at a joint R = 2, images are compressed more than text).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from configs.config import ConfigError


@dataclass
class Variant:
    name: str
    overrides: list[str]
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Recipe:
    name: str
    claim: str
    variants: list[Variant]
    steps: int                     # default optimizer steps per variant
    common: list[str] = field(default_factory=list)


def _image_compression() -> Recipe:
    # a frozen encoder stays at its random init (no warm-up: it would train it); a trained one gets the default's
    vision = {"frozen": ["vision.freeze_encoder=true", "vision_warmup.steps=0"], "trained": ["vision.freeze_encoder=false"]}
    targets = {"joint R=2": ["model.chunk.modality_target_ratios=null", "model.chunk.target_ratio=2"],
               "text 2 / image 2": ["model.chunk.modality_target_ratios={text: 2, image: 2}"]}
    grid = {"off": ["model.chunk.grid_aware_boundaries=false"], "on": ["model.chunk.grid_aware_boundaries=true"]}
    variants = []
    for (v, vo), (t, to), (g, go) in itertools.product(vision.items(), targets.items(), grid.items()):
        name = f"{v}-{'joint' if t.startswith('joint') else 'per_modality'}-grid_{g}"
        variants.append(Variant(name, vo + to + go, {"vision encoder": v, "targets": t, "2D-aware": g}))
    return Recipe("image-compression",
                  "ConceptMoE Figure 2c: at a joint R = 2 images are compressed more than text; "
                  "and the VLM answers from the image (VQA above the blind model)",
                  variants, steps=500)


RECIPES = {"image-compression": _image_compression}


def _train_cmd(out: Path, variant: Variant, steps: int, vqa_limit: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "vlm.cli", "train", "--out", str(out), f"train.max_steps={steps}",
            "train.threads=1", f"train.vqa_max_samples={vqa_limit}", "logging.progress=false",
            "checkpoint.save_every=0", *variant.overrides, *extra]


def _tail_mean(values: list[float], frac: float = 0.1) -> float | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    n = max(int(len(values) * frac), 1)
    return sum(values[-n:]) / n


def read_result(run_dir: Path) -> dict:
    """One table row from a finished run: VQA vs baselines, realized ratio per modality in training and held out."""
    summary = json.loads((run_dir / "summary.json").read_text())
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vqa = summary.get("vqa") or {}
    held = vqa.get("held_out_compression") or {}
    row = {"steps": summary.get("steps"), "wall_s": summary.get("wall_s"),
           "vqa": (vqa.get("accuracy") or {}).get("all"), "blind": (vqa.get("blind_baseline") or {}).get("all"),
           "majority": (vqa.get("majority_baseline") or {}).get("all"), "vqa_by_type": vqa.get("accuracy")}
    for mod in ("text", "image"):
        row[f"train_R_{mod}"] = _tail_mean([r.get(f"compression/{mod}") for r in recs])
        row[f"eval_R_{mod}"] = held.get(mod)
    return row


def _progress(runs: dict[str, Path], steps: int, bar) -> None:
    done = 0
    for d in runs.values():
        m = d / "metrics.jsonl"
        if m.is_file():
            with m.open() as f:
                done += sum(1 for _ in f)
    bar.n = min(done, bar.total)
    bar.refresh()


def run_recipe(name: str, out: Path, steps: int | None = None, jobs: int = 2, vqa_limit: int = 400,
               extra: list[str] | None = None, only: list[str] | None = None) -> dict:
    """Train every variant (skipping those already finished in `out`), then write OUT/results.json and a plot."""
    from tqdm import tqdm

    recipe = RECIPES[name]()
    steps = steps or recipe.steps
    variants = [v for v in recipe.variants if not only or v.name in only]
    out.mkdir(parents=True, exist_ok=True)
    runs = {v.name: out / v.name for v in variants}
    todo = [v for v in variants if not (runs[v.name] / "summary.json").is_file()]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    bar = tqdm(total=steps * len(variants), desc=f"{name} ({len(variants)} runs)", unit="step", disable=None)
    running: list[tuple[Variant, subprocess.Popen, object]] = []
    failed = []
    while todo or running:
        while todo and len(running) < jobs:
            v = todo.pop(0)
            log = (out / f"{v.name}.log").open("w")
            proc = subprocess.Popen(_train_cmd(runs[v.name], v, steps, vqa_limit, extra or []), stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
            running.append((v, proc, log))
        time.sleep(2)
        _progress(runs, steps, bar)
        for item in list(running):
            v, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                if proc.returncode != 0:
                    failed.append(v.name)
    bar.close()
    if failed:
        raise RuntimeError(f"runs failed: {', '.join(failed)} (see {out}/<name>.log)")
    rows = []
    for v in variants:
        rows.append({"variant": v.name, **v.labels, **read_result(runs[v.name])})
    result = {"recipe": name, "claim": recipe.claim, "steps": steps, "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    plot_image_compression(rows, out / "results.png")
    return result


def format_table(result: dict) -> str:
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    head = (f"{'vision':<8}{'targets':<17}{'2D':<4}{'VQA':>6}{'blind':>7}{'major':>7}"
            f"{'R_text tr/ev':>15}{'R_img tr/ev':>14}")
    lines = [f"{result['recipe']}: {result['claim']}", f"({result['steps']} steps per run; VQA exact match % on "
             "the held-out split; R = tokens per concept, train = last 10 % of steps, ev = held-out, eval mode)",
             head]
    for r in result["rows"]:
        lines.append(f"{r['vision encoder']:<8}{r['targets']:<17}{r['2D-aware']:<4}{f(r['vqa']):>6}"
                     f"{f(r['blind']):>7}{f(r['majority']):>7}"
                     f"{f(r['train_R_text'], 2) + '/' + f(r['eval_R_text'], 2):>15}"
                     f"{f(r['train_R_image'], 2) + '/' + f(r['eval_R_image'], 2):>14}")
    return "\n".join(lines)


def plot_image_compression(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["variant"].replace("-", "\n") for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8))
    ax = axes[0]
    val = lambda k: [r[k] if r[k] is not None else np.nan for r in rows]  # noqa: E731
    ax.bar(x - 0.27, val("vqa"), 0.27, label="model")
    ax.bar(x, val("blind"), 0.27, label="blind (no image)")
    ax.bar(x + 0.27, val("majority"), 0.27, label="majority answer")
    ax.set_xticks(x, names, fontsize=7), ax.set_ylabel("held-out VQA exact match (%)"), ax.legend()
    ax.set_title("does it look?")
    ax = axes[1]
    for k, (mod, c) in enumerate((("text", "tab:blue"), ("image", "tab:orange"))):
        ax.bar(x + (k - 0.5) * 0.4 - 0.1, val(f"train_R_{mod}"), 0.2, color=c, label=f"{mod} train")
        ax.bar(x + (k - 0.5) * 0.4 + 0.1, val(f"eval_R_{mod}"), 0.2, color=c, alpha=0.5, hatch="//",
               label=f"{mod} held-out")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x, names, fontsize=7), ax.set_ylabel("tokens per concept"), ax.legend(fontsize=8)
    ax.set_title("realized compression per modality")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_experiment_command(subparsers) -> None:
    p = subparsers.add_parser("experiment", help="train small variants side by side and print one table",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", choices=sorted(RECIPES), help="recipe to run")
    p.add_argument("--list", action="store_true", help="list the recipes and their claims")
    p.add_argument("--out", default=None, help="output directory (default: runs/experiments/NAME)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per variant (default: the recipe's)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default 2)")
    p.add_argument("--vqa-limit", type=int, default=400, help="held-out VQA questions per run (default 400)")
    p.add_argument("--only", nargs="+", default=None, help="run only these variants")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides applied to every variant")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:

    if args.list or not args.name:
        for name, make in RECIPES.items():
            r = make()
            print(f"{name}: {r.claim} ({len(r.variants)} runs x {r.steps} steps)")
        return 0
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    out = Path(args.out or f"runs/experiments/{args.name}")
    result = run_recipe(args.name, out, args.steps, args.jobs, args.vqa_limit, args.overrides, args.only)
    print(format_table(result))
    print(f"results: {out / 'results.json'}, {out / 'results.png'}")
    return 0
