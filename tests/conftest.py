"""Shared fixtures of the dufu test suite (helpers that tests import live in dufu_testing.py).

* One dufu cache directory per test session (``DUFU_CACHE_DIR``): a run never writes to ``~``, and the
  byte-level dataset of the built-in corpus is tokenized once per session, not once per test.
* ``train_run``: train the ``gpt_debug`` recipe in-process with a few overrides.
* ``debug_run``: one complete 10-step run (checkpoints at steps 5 and 10, evaluation, TensorBoard,
  generation), trained once per session; tests that change it work on a copy (``copy_run``).
* ``run_cli``: ``python -m dufu ...`` in a subprocess, for the few tests where the exit code and
  stderr of a real process matter. Every test starts processes through tests/launch.py, forked from the session's
  warm process server where a new interpreter would behave the same (tests/warm.py).
* ``reference_run``: the single-process reference of a parity test (tests/parity.py), trained in this process
  once per session for each config and overrides, whichever tests compare with it.
* ``shared_runs``: a module's multi-process runs in shared launches (tests/parity.py's SharedRuns), limited to
  the runs of the tests selected.
* The checkpoint tests' background runs (tests/checkpoint/checkpoint_runs.py) start when the session starts, and
  tests/checkpoint runs last: the runs train while the single-process tests run in this process, which uses
  one thread (the other core would wait), and are done when the checkpoint tests read them.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `import dufu_testing` from any test directory

import launch  # noqa: E402
from dufu_testing import DEBUG_RUN_OVERRIDES, Run, environment, train  # noqa: E402
from parity import PARITY_ARGS, SharedRuns, collect  # noqa: E402

# The tiny models of these tests gain nothing from a second thread, and when other processes share
# the machine, OpenMP's spinning threads slow every small kernel down many times over.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def dufu_cache_dir(tmp_path_factory):
    """One cache directory for the session: caches make later runs fast, and nothing goes to ~/.cache."""
    path = tmp_path_factory.mktemp("dufu_cache")
    old = os.environ.get("DUFU_CACHE_DIR")
    os.environ["DUFU_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DUFU_CACHE_DIR", None)
    else:
        os.environ["DUFU_CACHE_DIR"] = old


CHECKPOINT_TESTS = Path(__file__).resolve().parent / "checkpoint"


def pytest_collection_modifyitems(session, config, items):
    """tests/checkpoint last (in their own order), after the tests its background runs train beside."""
    last = [item for item in items if CHECKPOINT_TESTS in Path(str(item.path)).resolve().parents]
    if last:
        items[:] = [item for item in items if CHECKPOINT_TESTS not in Path(str(item.path)).resolve().parents] + last


@pytest.fixture(scope="session", autouse=True)
def _warm_process_server(tmp_path_factory, dufu_cache_dir):
    """The processes the tests start are forked from a server that imported torch and dufu once
    (tests/warm.py), started with the session (after ``DUFU_CACHE_DIR`` is set: it is in the server's environment)."""
    launch.start_warm_server(tmp_path_factory.mktemp("warm"))
    yield
    launch.stop_warm_server()


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_runs_in_background(request, tmp_path_factory, dufu_cache_dir, _warm_process_server):
    """Start the checkpoint tests' background runs with the session, when any of those tests is selected."""
    if not any(item.get_closest_marker("checkpoint_jobs") for item in request.session.items):
        yield
        return
    sys.path.insert(0, str(CHECKPOINT_TESTS))
    import checkpoint_runs

    checkpoint_runs.session_pool(request.session.items, lambda: tmp_path_factory.mktemp("checkpoint_runs"))
    yield
    checkpoint_runs.shutdown_session_pool()


@pytest.fixture
def train_run(tmp_path):
    """``train_run(*overrides, name="run", resume=False, fast=True)``: a gpt_debug run in ``tmp_path/name``."""

    def run(*overrides, name: str = "run", resume: bool = False, fast: bool = True) -> Run:
        return train(tmp_path / name, overrides, resume=resume, fast=fast)

    return run


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory, dufu_cache_dir) -> Run:
    """gpt_debug for 10 steps, checkpoints at 5 and 10. Read-only: copy it (``copy_run``) to change it."""
    return train(tmp_path_factory.mktemp("debug_run") / "run", DEBUG_RUN_OVERRIDES, fast=False)


@pytest.fixture
def copy_run(debug_run, tmp_path):
    """``copy_run(name="run")``: a private copy of the session's debug run directory."""

    def copy(name: str = "run") -> Path:
        dest = tmp_path / name
        shutil.copytree(debug_run.output_dir, dest)
        return dest

    return copy


@pytest.fixture
def run_cli(tmp_path):
    """``run_cli(*args, cwd=tmp_path)``: ``python -m dufu *args`` in a subprocess (tests/launch.py) -> launch.Proc
    (``returncode``, ``stdout``, ``stderr``)."""

    def run(*args, cwd=None, timeout: float = 120) -> launch.Proc:
        return launch.run(launch.dufu_command(*args), cwd=cwd or tmp_path, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, dufu_cache_dir):
    """``reference_run(config, *overrides, env=())`` -> the RunResult of ``dufu train CONFIG PARITY_ARGS
    overrides`` on one process, trained in this process the first time a test asks for it (``env``: variables
    set while it trains, e.g. a ``DUFU_FAULT``). Read-only: every test comparing with it shares it."""
    cache = {}

    def get(config: str = "gpt_debug", *overrides: str, env=()):
        key = (str(config), *overrides, tuple(env))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"reference_{Path(str(config)).stem}") / "run"
            with environment(env):
                train(out, (*PARITY_ARGS, *overrides), recipe=str(config), fast=False)
            cache[key] = collect(out)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def shared_runs(request, tmp_path_factory, dufu_cache_dir):
    """``shared_runs(specs, uses=None)`` -> a SharedRuns (tests/parity.py) of ``specs`` ({name: Spec}) for this
    module, launching only the runs its selected tests need. A test needs the run named by its ``layout``
    parameter, unless ``uses`` maps its function's name to a run name, a tuple of them, or a function of its
    parameters (``item.callspec.params``) returning either."""

    def make(specs: dict, uses=None) -> SharedRuns:
        wanted = set()
        for item in request.session.items:
            if getattr(item, "module", None) is not request.module:
                continue
            params = item.callspec.params if hasattr(item, "callspec") else {}
            used = (uses or {}).get(getattr(item, "originalname", item.name), params.get("layout"))
            used = used(params) if callable(used) else used
            wanted.update([used] if isinstance(used, str) else used or ())
        return SharedRuns(tmp_path_factory.mktemp(f"shared_{request.module.__name__}"), specs, wanted)

    return make


# Every test file this session collected a test from, or whose module it skipped whole at import: the files CI's
# collection sees (tests/test_collection.py), recorded before any -k / -m deselection.
COLLECTED: set[str] = set()


def pytest_itemcollected(item):
    COLLECTED.add(Path(str(item.path)).resolve().relative_to(launch.REPO).as_posix())


def pytest_collectreport(report):
    if report.skipped and report.nodeid.endswith(".py"):
        COLLECTED.add(report.nodeid)


@pytest.fixture(scope="session")
def collected_files() -> set[str]:
    return COLLECTED


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_session():
    yield
    launch.stop_all()


def pytest_terminal_summary(terminalreporter):
    """Runs that passed only on their retry after a death by signal (tests/launch.py): counted and shown, so CI
    tells when one happened. And how the session's processes started (tests/warm.py)."""
    terminalreporter.write_line(f"processes started: {launch.STARTS['forked']} forked from the warm server, "
                                f"{launch.STARTS['new']} as new interpreters")
    for why, count in sorted(launch.STARTED_NEW.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"  {count} new: {why}")
    if not launch.RETRIES:
        terminalreporter.write_line("no process was retried after a death by signal")
        return
    terminalreporter.section(f"{len(launch.RETRIES)} process(es) retried after a death by signal")
    for cmd, stderr in launch.RETRIES:
        terminalreporter.write_line(f"$ {cmd}\n{stderr}\n")
