"""The `vlm experiment` subcommand (registered in pyproject.toml's `vlm.commands`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from configs.config import ConfigError


def _recipes() -> dict:
    from eval.experiments.registry import RECIPES

    return RECIPES


def add_experiment_command(subparsers) -> None:
    p = subparsers.add_parser(
        "experiment",
        help="reproduce a paper finding: train variants side by side over seeds, judge the claim",
        description="Recipes reproducing the papers' findings at CPU scale (`--list` names "
        "them). Each trains its variants as ordinary `vlm train` runs under OUT, then "
        "writes results.json, results.txt and results.png with the verdict on the claim.",
    )
    p.add_argument("name", nargs="?", default=None, help="recipe to run (see --list)")
    p.add_argument(
        "--list", action="store_true", help="list the recipes: claim, runs x steps, estimated time"
    )
    p.add_argument(
        "--all", action="store_true", help="run every recipe under OUT/NAME and write OUT/claims.md"
    )
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default: runs/experiments/NAME, or runs/experiments with --all)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per variant (train.seed = 0..N-1; default: the recipe's, at least 2)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per variant (default: the recipe's)",
    )
    p.add_argument(
        "--jobs", type=int, default=2, help="job slots, one torch thread each (default 2)"
    )
    p.add_argument(
        "--vqa-limit",
        type=int,
        default=None,
        help="held-out VQA questions per run (image-compression; same as train.vqa_max_samples=N)",
    )
    p.add_argument(
        "--only", nargs="+", default=None, help="run only these variants (and what they need)"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides applied to every variant",
    )
    p.set_defaults(func=_command)


def _steps_text(recipe, steps: int | None, seeds: int | None) -> str:
    from eval.experiments.runner import plan

    jobs = plan(recipe, Path("/nonexistent"), steps, seeds)
    counts: dict[int, int] = {}
    for j in jobs:
        counts[j.steps] = counts.get(j.steps, 0) + 1
    parts = [f"{n} runs x {s} steps" for s, n in sorted(counts.items(), reverse=True)]
    return " + ".join(parts)


def list_recipes(jobs: int = 2, steps: int | None = None, seeds: int | None = None) -> str:
    from eval.experiments.runner import estimate_s

    lines = []
    for name, make in _recipes().items():
        r = make()
        n_var = len(r.variants)
        lines.append(f"{name} ({r.source}): {r.claim}")
        lines.append(
            f"    {n_var} variants x {seeds or r.seeds} seeds: {_steps_text(r, steps, seeds)}; "
            f"~{estimate_s(r, jobs, steps, seeds) / 60:.0f} min with --jobs {jobs}"
        )
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> int:
    from eval.experiments.report import claims_markdown, format_table
    from eval.experiments.runner import run_recipe

    recipes = _recipes()
    # `--all key=value`: the first override landed in NAME's place
    if args.name and "=" in args.name:
        args.overrides, args.name = [args.name, *args.overrides], None
    if args.list or (not args.name and not args.all):
        print(list_recipes(args.jobs, args.steps, args.seeds))
        return 0
    if args.name and args.all:
        raise ConfigError("give a recipe NAME or --all, not both")
    if args.name and args.name not in recipes:
        raise ConfigError(f"unknown recipe {args.name!r}; recipes: {', '.join(recipes)}")
    extra = list(args.overrides) + (
        [f"train.vqa_max_samples={args.vqa_limit}"] if args.vqa_limit else []
    )
    from eval.preflight import check_out_dir

    # before the first run trains: a file named as --out is one line, not a traceback later
    default = f"runs/experiments/{args.name}" if args.name else "runs/experiments"
    check_out_dir(args.out or default, "vlm experiment")
    if args.name:
        out = Path(args.out or f"runs/experiments/{args.name}")
        result = run_recipe(
            recipes[args.name](), out, args.steps, args.seeds, args.jobs, extra, args.only
        )
        print(format_table(result))
        print(f"results: {out / 'results.json'}, {out / 'results.txt'}, {out / 'results.png'}")
        return 0
    if args.only:
        raise ConfigError("--only names variants of one recipe; it does not go with --all")
    root = Path(args.out or "runs/experiments")
    results, skipped = [], {}
    for name, make in recipes.items():
        recipe = make()
        try:
            result = run_recipe(recipe, root / name, args.steps, args.seeds, args.jobs, extra)
        except (RuntimeError, ConfigError) as e:  # one failed recipe does not stop the others
            skipped[name] = str(e)
            print(f"{name}: {e}")
            continue
        print(format_table(result) + "\n")
        results.append(result)
    root.mkdir(parents=True, exist_ok=True)
    (root / "claims.md").write_text(claims_markdown(results, skipped))
    print(f"claims: {root / 'claims.md'}")
    return 0 if not skipped else 1
