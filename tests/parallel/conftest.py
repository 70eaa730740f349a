"""Single-process reference runs shared by the parity tests of this directory, each run once per session."""

from __future__ import annotations

import pytest

from parity import parity_run


@pytest.fixture(scope="session")
def recipe_reference(tmp_path_factory):
    """``recipe_reference("bert_debug", *overrides)`` -> the RunResult of PARITY_ARGS + overrides on one process."""
    cache = {}

    def get(recipe: str, *overrides: str):
        key = (recipe, *overrides)
        if key not in cache:
            cache[key] = parity_run(tmp_path_factory.mktemp(f"reference_{recipe}"), 1, *overrides, config=recipe)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def parity_reference(recipe_reference):
    """gpt_debug references by depth: ``parity_reference(2, *overrides)``."""

    def get(num_layers: int = 2, *overrides: str):
        return recipe_reference("gpt_debug", f"model.num_layers={num_layers}", *overrides)

    return get
