"""`vlm experiment`: every recipe's variants are valid configs of the default run (a recipe that cannot start
would only fail after its first runs were launched)."""
from pathlib import Path

import pytest

from eval.experiments import RECIPES


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_variant_of_every_recipe_is_a_valid_default_config(name):
    from vlm.train.config import load_train_config

    recipe = RECIPES[name]()
    assert recipe.variants and len({v.name for v in recipe.variants}) == len(recipe.variants)
    for v in recipe.variants:
        cfg = load_train_config(Path(__file__).resolve().parents[1] / "configs" / "default.yaml",
                                recipe.common + v.overrides)
        assert cfg.train.stage == "vl", v.name
