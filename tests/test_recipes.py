"""The learner runs every recipe the config knows, and knows no other."""

from __future__ import annotations

import pytest

from learner.runtime import Runtime
from learner.train import RECIPE_CLASSES, RECIPES, recipe_class
from tandem.config import RECIPE_CONFIGS


def test_the_learner_registry_matches_the_config_recipes() -> None:
    assert set(RECIPE_CLASSES) == set(RECIPE_CONFIGS)
    assert tuple(RECIPE_CLASSES) == RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_loads_a_learner(recipe: str) -> None:
    assert issubclass(recipe_class(recipe), Runtime)


def test_an_unknown_recipe_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown recipe 'ppg'"):
        recipe_class("ppg")
