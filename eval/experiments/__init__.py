"""`vlm experiment`: recipes that reproduce the papers' findings at CPU scale, one
recipe per finding.

Each recipe trains small variants side by side with everything else equal, over several seeds, as
ordinary `vlm train` runs with dotted overrides (so every number can be reproduced and inspected
from its run directory), prints one table (mean and min-max over seeds), draws one plot, and judges
its claim from the numbers: holds, does not hold at this scale, or inconclusive when the seed
spreads overlap.

    vlm experiment --list
    vlm experiment NAME [--out DIR] [--seeds N] [--steps N] [--jobs J] [--only VARIANT ...] [key=value ...]
    vlm experiment --all --out DIR          # every recipe, then DIR/claims.md (claim | measured | holds?)

The command itself is `eval.experiments.cli` (registered there in pyproject.toml); this package
imports nothing from it, so the two never import each other.
"""

from __future__ import annotations

from eval.experiments.core import Check, Metric, Recipe, Run, Stat, Variant
from eval.experiments.registry import RECIPES
from eval.experiments.runner import estimate_s, plan, run_recipe

__all__ = [
    "RECIPES",
    "Recipe",
    "Variant",
    "Metric",
    "Stat",
    "Check",
    "Run",
    "plan",
    "run_recipe",
    "estimate_s",
]
