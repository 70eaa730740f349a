"""Runs shared by the checkpoint tests.

* ``reference``: run A, the uninterrupted single-process run (10 steps, checkpoints at 5 and 10), trained
  in this process; every other run is compared with it.
* ``jobs``: the background :class:`~checkpoint_runs.JobPool` of real multi-process runs. A test names the
  runs it needs with ``@pytest.mark.checkpoint_jobs(...)``; all runs needed by the selected tests start
  in the background when the session starts (tests/conftest.py; this directory's tests run last), and
  ``jobs.result(name)`` waits for one.
"""

from __future__ import annotations

import pytest

from checkpoint_runs import COMMON, JobPool, session_pool


def pytest_configure(config):
    config.addinivalue_line("markers", "checkpoint_jobs(*names): background runs (tests/checkpoint) a test needs")


@pytest.fixture(scope="session")
def jobs(tmp_path_factory, dufu_cache_dir, request) -> JobPool:
    """The session's background runs (:func:`checkpoint_runs.session_pool`): started at the session's start by
    tests/conftest.py when the checkpoint tests are selected, else here."""
    return session_pool(request.session.items, lambda: tmp_path_factory.mktemp("checkpoint_runs"))


@pytest.fixture(autouse=True)
def _start_background_runs(request):
    """The first test of this directory starts every background run the selected tests need."""
    if any(item.get_closest_marker("checkpoint_jobs") for item in request.session.items):
        request.getfixturevalue("jobs")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, dufu_cache_dir):
    """Run A: one process, 10 uninterrupted steps, checkpoints at 5 and 10 (trained in this process)."""
    from dufu_testing import train

    return train(tmp_path_factory.mktemp("checkpoint_reference") / "run", COMMON)
