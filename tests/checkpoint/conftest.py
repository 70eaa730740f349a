"""Runs shared by the checkpoint tests.

* ``reference``: run A, the uninterrupted single-process run (10 steps, checkpoints at 5 and 10), trained
  in this process; every other run is compared with it.
* ``jobs``: the background :class:`~checkpoint_runs.JobPool` of real multi-process runs. A test names the
  runs it needs with ``@pytest.mark.checkpoint_jobs(...)``; all runs needed by the selected tests start
  in the background when the first of these tests starts, and ``jobs.result(name)`` waits for one.
"""

from __future__ import annotations

import os
import shutil

import pytest

from checkpoint_runs import COMMON, RESUME_TARGETS, JobPool, layout
from launch import assert_ok, run, train_command

# Start order of the background runs.
PRIORITY = (
    "run_b", "hang_fault", *(f"resume_{t}" for t in RESUME_TARGETS), "async_run", "kill_dp2", "kill_1",
    "restart", "exit_fault", "stop_minutes", "corrupt_resume_dp2",
    "nan_stop_tp2", "nan_skip_tp2", "nan_stop_dp2", "nan_skip_dp2",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "checkpoint_jobs(*names): background runs (tests/checkpoint) a test needs")


def _define_jobs(pool: JobPool, root) -> None:
    def fresh(name):
        path = root / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def run_b(pool):
        """Run B: 4 processes (dp 2 x tp 2), stopped by train.stop_at_iter=5 (checkpoint at step 5)."""
        out = fresh("b")
        n, dist = layout("dp2_tp2")
        return run(train_command("gpt_debug", out, n, *COMMON, *dist, "train.stop_at_iter=5"), output_dir=out)

    pool.define("run_b", run_b)

    def resume(target):
        def job(pool):
            """A copy of run B resumed in another layout: its config.yaml plus train.dist overrides."""
            b = pool.result("run_b")
            assert_ok(b)
            out = fresh(f"resume_{target}")
            shutil.copytree(b.output_dir, out)
            n, dist = layout(target)
            return run(train_command(out / "config.yaml", out, n, *dist, resume=True), output_dir=out)

        return job

    for target in RESUME_TARGETS:
        pool.define(f"resume_{target}", resume(target), deps=("run_b",))

    def simple(name, lay, *overrides, fault=None, flags=()):
        def job(pool):
            out = fresh(name)
            n, dist = layout(lay)
            return run(train_command("gpt_debug", out, n, *COMMON, *dist, *overrides, flags=flags),
                       fault=fault, output_dir=out)

        pool.define(name, job)

    # A save at every step (all kept), so that background saves overlap training steps often; a deadlock
    # ends after 30 s.
    simple("async_run", "dp2_tp2", "train.checkpointer.async_save=True", "train.checkpointer.period=1",
           "train.checkpointer.max_to_keep=0", "train.dist.timeout_minutes=0.5")
    # ~1 ms: over after the first step. Rank 0's clock decides, for every rank.
    simple("stop_minutes", "dp2", "train.stop_after_minutes=1e-05")

    def kill_in_save(lay):
        def job(pool):
            """SIGKILL the job while it saves step 10 (shards written, not committed); keep a copy of the
            checkpoints directory as the crash left it; then resume with --resume in the same layout."""
            out = fresh(f"kill_{lay}")
            n, dist = layout(lay)
            crashed = run(train_command("gpt_debug", out, n, *COMMON, *dist), fault="kill_in_save:0:10",
                          output_dir=out)
            after_crash = fresh(f"kill_{lay}_after_crash")  # checkpoints/ and metrics.jsonl
            after_crash.mkdir()
            for name in ("checkpoints", "metrics.jsonl"):
                if (out / name).is_dir():
                    shutil.copytree(out / name, after_crash / name)
                elif (out / name).is_file():
                    shutil.copyfile(out / name, after_crash / name)
            resumed = run(train_command(out / "config.yaml", out, n, *dist, resume=True), output_dir=out)
            return crashed, after_crash, resumed

        pool.define(f"kill_{lay}", job)

    kill_in_save("1")
    kill_in_save("dp2")
    simple("exit_fault", "dp2", fault="exit:1:3")
    simple("hang_fault", "dp2", "train.dist.timeout_minutes=0.25", fault="hang:1:3")
    simple("restart", "dp2_tp2", fault="kill:2:7", flags=("--max-restarts", "1"))
    nan_args = ("train.train_iter=5", "train.dist.timeout_minutes=0.25")
    for lay in ("tp2", "dp2"):
        simple(f"nan_stop_{lay}", lay, *nan_args, fault="nan:0:3")
        simple(f"nan_skip_{lay}", lay, *nan_args, "train.nan_policy=skip", fault="nan:0:3")

    def corrupt_resume(pool):
        """A copy of run B with one flipped byte in a shard, resumed by a 2-process job."""
        b = pool.result("run_b")
        assert_ok(b)
        out = fresh("corrupt_resume_dp2")
        shutil.copytree(b.output_dir, out)
        shard = out / "checkpoints" / "step_0000005" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        n, dist = layout("dp2")
        return shard, run(train_command(out / "config.yaml", out, n, *dist, resume=True), output_dir=out)

    pool.define("corrupt_resume_dp2", corrupt_resume, deps=("run_b",))


@pytest.fixture(scope="session")
def jobs(tmp_path_factory, dufu_cache_dir, request) -> JobPool:
    pool = JobPool(int(os.environ.get("DUFU_TEST_JOBS", "2")))
    _define_jobs(pool, tmp_path_factory.mktemp("checkpoint_runs"))
    wanted = set()
    for item in request.session.items:
        for marker in item.iter_markers("checkpoint_jobs"):
            wanted.update(marker.args)
    unknown = wanted - set(pool.jobs)
    assert not unknown, f"unknown background runs {sorted(unknown)}"
    pool.want([name for name in PRIORITY if name in wanted] + sorted(wanted - set(PRIORITY)))
    yield pool
    pool.shutdown()


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
