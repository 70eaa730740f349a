"""Single-process reference runs shared by the parity tests of this directory (tests/conftest.py's
``reference_run``: each trained once per session, in the test process)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def recipe_reference(reference_run):
    """``recipe_reference("bert_debug", *overrides)`` -> the RunResult of PARITY_ARGS + overrides on one process."""
    return reference_run


@pytest.fixture(scope="session")
def parity_reference(reference_run):
    """gpt_debug references by depth: ``parity_reference(2, *overrides)``."""

    def get(num_layers: int = 2, *overrides: str):
        return reference_run("gpt_debug", f"model.num_layers={num_layers}", *overrides)

    return get


# test (module, function) -> the worker case of a selected test, from its layout (test_activation_checkpoint.py)
SELECTIVE_CASES = {
    ("test_activation_checkpoint", "test_selective_matches_one_process_on_two_ranks"): "{layout}:selective",
    ("test_compile", "test_compiled_selective_checkpointing_matches_one_process"): "{layout}:selective:compile",
}


@pytest.fixture(scope="session")
def selective_checkpointing_runs(request, tmp_path_factory):
    """``selective_checkpointing_runs(case)`` -> the directory holding each rank's ``rank_R.json`` of one case of
    test_activation_checkpoint.py's 2-process worker (``LAYOUT:MODE[:compile]``). The cases of every selected
    test run in one job, the first time a test asks for one (tests/launch.py's run_in_turn)."""
    import launch

    wanted = []
    for item in request.session.items:
        case = SELECTIVE_CASES.get((item.module.__name__, getattr(item, "originalname", ""))) \
            if hasattr(item, "module") else None
        if case is not None and case.format(**item.callspec.params) not in wanted:
            wanted.append(case.format(**item.callspec.params))
    wanted.sort(key=lambda case: case.endswith("compile"))  # the eager cases first
    root = tmp_path_factory.mktemp("selective_checkpointing")
    worker = launch.REPO / "tests" / "parallel" / "test_activation_checkpoint.py"
    outcomes = {}

    def get(case: str):
        if case not in outcomes:
            pending = [c for c in wanted if c not in outcomes] if case in wanted else [case]
            outcomes.update(launch.run_in_turn(
                pending, lambda job, cases: launch.torchrun_command(worker, 2, f"train.output_dir={job}", *cases),
                root, timeout=600))
        job, failure = outcomes[case]
        assert failure is None, failure
        return job / case

    return get
