"""Fixtures for multi-process tests."""

from __future__ import annotations

import pytest

from parallel_runs import PARITY_ARGS, assert_ok, final_model_state, losses, run_dufu


@pytest.fixture(scope="session")
def parity_reference(tmp_path_factory):
    """Single-process reference runs, one per model depth used by the layouts."""
    cache = {}

    def get(num_layers: int = 2):
        if num_layers not in cache:
            out = tmp_path_factory.mktemp(f"reference_{num_layers}l")
            assert_ok(run_dufu(out, 1, *PARITY_ARGS, f"model.num_layers={num_layers}"))
            cache[num_layers] = (losses(out), final_model_state(out))
        return cache[num_layers]

    return get


@pytest.fixture(scope="session")
def recipe_reference(tmp_path_factory):
    """Single-process reference runs of PARITY_ARGS for a recipe (and extra overrides), each run once:
    ``recipe_reference("bert_debug")`` -> (losses, final model state)."""
    cache = {}

    def get(recipe: str, *overrides: str):
        key = (recipe, *overrides)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"reference_{recipe}")
            assert_ok(run_dufu(out, 1, *PARITY_ARGS, *overrides, config=recipe))
            cache[key] = (losses(out), final_model_state(out))
        return cache[key]

    return get
