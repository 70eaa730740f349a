"""Helpers for the checkpoint and fault-handling tests: real `dufu train` processes, run in the background.

Every run here is `python -m dufu train ...` in a subprocess (through dufu's own torchrun launcher for
``--nproc N``), started by tests/launch.py, because what is tested is what a user sees: exit codes, messages,
files on disk. The
runs are expensive on a small CPU machine, so a :class:`JobPool` starts them in the background as soon
as the session knows it needs them (at most ``DUFU_TEST_JOBS``, default 2, at a time, on a thread pool),
respecting dependencies (a resume needs the run it resumes); a test then waits for the result it needs.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from launch import Proc, _kill_processes_with_argument, assert_ok, run, start, stop_all, train_command
from parity import PARITY_ARGS

# Every run: gpt_debug (fp32, no dropout), 10 steps, checkpoints at 5 and 10, and the same global batch,
# so every layout sees the same samples in the same order and reaches the same weights.
COMMON = (
    "train.train_iter=10",
    "train.global_batch_size=8",
    "train.train_micro_batch_size=2",
    "train.checkpointer.period=5",
    "train.evaluation.enabled=False",
    "train.tensorboard=False",
    "train.generation.enabled=False",
    "train.peak_tflops=1.0",
    "train.log_period=1",
    "train.plan_memory=False",
)

# name -> (processes, overrides). Every size is given, so a layout override replaces the one in a
# resumed run's config.yaml completely.
LAYOUTS = {
    "1": (1, dict(dp=1, tp=1, pp=1)),
    "dp2": (2, dict(dp=2, tp=1, pp=1)),
    "tp2": (2, dict(dp=1, tp=2, pp=1)),
    "pp2": (2, dict(dp=1, tp=1, pp=2)),
    "dp2_tp2": (4, dict(dp=2, tp=2, pp=1)),
    "tp4": (4, dict(dp=1, tp=4, pp=1)),
    "tp2_pp2": (4, dict(dp=1, tp=2, pp=2)),
    "dp4_zero3": (4, dict(dp=4, tp=1, pp=1, zero=3)),
}

# Layouts a copy of run B (dp 2 x tp 2, stopped at step 5) is resumed in, by background runs.
RESUME_TARGETS = ("tp4", "pp2", "dp4_zero3", "tp2_pp2")


def layout(name: str) -> tuple[int, tuple[str, ...]]:
    """(number of processes, train.dist / zero_optimization overrides) of a named layout."""
    nproc, d = LAYOUTS[name]
    overrides = [
        f"train.dist.data_parallel_size={d['dp']}",
        f"train.dist.tensor_parallel_size={d['tp']}",
        f"train.dist.pipeline_parallel_size={d['pp']}",
        f"train.zero_optimization.enabled={'zero' in d}",
    ]
    if "zero" in d:
        overrides.append(f"train.zero_optimization.stage={d['zero']}")
    return nproc, tuple(overrides)


def error_text(proc: Proc) -> str:
    """The paragraphs dufu printed as ``error: ...`` (each rank's), joined into one line each."""
    text = proc.stderr
    found = []
    for m in re.finditer(r"error: ", text):
        chunk = text[m.start():m.start() + 1200]
        lines = []
        for i, line in enumerate(chunk.splitlines()):
            if i and (not line.strip() or re.match(r"^(\[|[WEI]\d{4} |Traceback|train |=)", line)):
                break
            lines.append(line.strip())
        found.append(" ".join(lines))
    return "\n".join(found)


# ------------------------------------------------------------------------------------------ results


def checkpoint_names(output_dir) -> list[str]:
    root = Path(output_dir) / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def consolidated(ckpt: Path, group: str = "model") -> dict:
    """A checkpoint's full ``model`` (through the public Checkpointer API) or ``optim`` state, in this process."""
    from dufu.engine.weights.checkpoint import Checkpointer

    ckpt = Path(ckpt)
    checkpointer = Checkpointer(ckpt.parent)
    if group == "model":
        return checkpointer.consolidated_model_state(ckpt)
    import warnings

    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dufu.engine.weights.checkpoint import SafeFileSystemReader, SafeLoadPlanner

    class Planner(_EmptyStateDictLoadPlanner):
        load_bytes = SafeLoadPlanner.load_bytes

    checkpointer.verify(ckpt)
    state: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        _load_state_dict(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=Planner(keys={group}),
                         no_dist=True)
    return state[group]


# ------------------------------------------------------------------------------------------ job pool


class JobFailed(Exception):
    pass


class JobPool:
    """Background jobs with dependencies on the standard library's thread pool (at most ``max_running`` at a
    time). ``define(name, fn, deps)``: ``fn(pool)`` reads its dependencies with ``pool.result(dep)``;
    ``want(names)`` starts jobs, a job going to the executor only once its dependencies are done (so no worker
    sits waiting for one); ``result(name)`` waits for a job and raises :class:`JobFailed` if it failed."""

    def __init__(self, max_running: int = 2):
        self.executor = ThreadPoolExecutor(max(1, max_running), thread_name_prefix="job")
        self.jobs: dict[str, tuple[Callable, tuple[str, ...]]] = {}
        self.futures: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.closed = False

    def define(self, name: str, fn: Callable, deps: tuple[str, ...] = ()) -> None:
        self.jobs[name] = (fn, tuple(deps))

    def want(self, names) -> None:
        for name in names:
            self._future(name)

    def _future(self, name: str) -> Future:
        with self.lock:
            if name in self.futures:
                return self.futures[name]
            outer = self.futures[name] = Future()
        fn, deps = self.jobs[name]
        waiting = [self._future(dep) for dep in deps]
        left = [len(waiting)]

        def submit() -> None:
            failed = [d for d, f in zip(deps, waiting) if f.exception() is not None]
            if failed or self.closed:
                why = f"a job it needs failed ({', '.join(failed)})" if failed else "the test session ended"
                outer.set_exception(JobFailed(f"{name}: {why}"))
                return
            inner = self.executor.submit(fn, self)
            inner.add_done_callback(lambda f: outer.set_exception(f.exception()) if f.exception() is not None
                                    else outer.set_result(f.result()))

        def dependency_done(_) -> None:
            with self.lock:
                left[0] -= 1
                ready = left[0] == 0
            if ready:
                submit()

        if not waiting:
            submit()
        for f in waiting:
            f.add_done_callback(dependency_done)
        return outer

    def shutdown(self) -> None:
        """Start nothing more, and end the runs in progress."""
        self.closed = True
        self.executor.shutdown(wait=False, cancel_futures=True)
        stop_all()

    def result(self, name: str):
        future = self._future(name)
        error = future.exception()
        if error is not None:
            if isinstance(error, JobFailed):
                raise error
            raise JobFailed(f"{name} failed: {error!r}") from error
        return future.result()


# ------------------------------------------------------------------------------------------ the session's runs


# Start order of the background runs.
PRIORITY = (
    "elastic", "elastic_reference", "run_b", "hang_fault", *(f"resume_{t}" for t in RESUME_TARGETS), "async_run", "kill_dp2", "kill_1",
    "restart", "exit_fault", "stop_minutes", "corrupt_resume_dp2",
    "nan_stop_tp2", "nan_skip_tp2", "nan_stop_dp2", "nan_skip_dp2",
)


def define_jobs(pool: JobPool, root) -> None:
    """Every background run the checkpoint tests may name (``@pytest.mark.checkpoint_jobs``), into ``pool``."""
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

    def elastic_reference(pool):
        out = fresh("elastic_reference")
        return run(train_command("gpt_debug", out, 1, *PARITY_ARGS, *ELASTIC_RUN), output_dir=out)

    def elastic(pool):
        """test_elastic's two local nodes (its docstring): a job that mostly waits for collective timeouts and
        restarts, so it runs here, beside the single-process tests, instead of holding up the session."""
        out = fresh("elastic")
        port = free_port()
        flags = ("--nnodes", "1:2", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "elastic-test",
                 "--max-restarts", "2")
        cmd = train_command("gpt_debug", out, 2, *PARITY_ARGS, *ELASTIC_RUN, "train.dist.data_parallel_size=-1",
                            flags=flags)
        # No output_dir for launch's clean-up: the lost node's launcher ends first, and its clean-up (every
        # process with this output_dir on its command line) would take the surviving node's workers with it.
        # The rendezvous store lives in this process, as on a cluster where it runs on a machine of its own:
        # whichever node's agent would host it (the first to bind the port; c10d rendezvous gives ranks 2-3 to
        # either node) may be the lost one, which took the store with it and the survivor could not rendezvous
        # again. The agents find the port taken and join as clients (torch's c10d rendezvous backend).
        store = torch.distributed.TCPStore("localhost", port, is_master=True, wait_for_workers=False)
        try:
            nodes = [start(cmd, fault="kill_node:3:12", retry=False, timeout=400) for _ in range(2)]
            procs = [n.result() for n in nodes]
        finally:
            _kill_processes_with_argument(f"train.output_dir={out}")
            del store
        return out, procs

    pool.define("elastic_reference", elastic_reference)
    pool.define("elastic", elastic)


# test_elastic's run: a short collective timeout, so the surviving node notices the lost one quickly
ELASTIC_RUN = ("train.train_iter=20", "train.checkpointer.period=10", "train.log_period=1",
               "train.dist.timeout_minutes=0.1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


_POOL: list = []  # the session's pool, once started


def session_pool(items, make_root) -> JobPool:
    """The session's pool of background runs, started the first time it is asked for: every run the selected
    tests ``items`` name (``@pytest.mark.checkpoint_jobs``), in PRIORITY order, at most ``DUFU_TEST_JOBS``
    (default 2) at a time; ``make_root()`` makes their directory. tests/conftest.py starts it when the session
    starts, so that the runs train beside the single-process tests (which use one core) and are done when the
    checkpoint tests, run last, read them."""
    if not _POOL:
        pool = JobPool(int(os.environ.get("DUFU_TEST_JOBS", "2")))
        define_jobs(pool, make_root())
        wanted = set()
        for item in items:
            for marker in item.iter_markers("checkpoint_jobs"):
                wanted.update(marker.args)
        unknown = wanted - set(pool.jobs)
        assert not unknown, f"unknown background runs {sorted(unknown)}"
        pool.want([name for name in PRIORITY if name in wanted] + sorted(wanted - set(PRIORITY)))
        _POOL.append(pool)
    return _POOL[0]


def shutdown_session_pool() -> None:
    """Start nothing more, and end the runs in progress (at the end of the session)."""
    if _POOL:
        _POOL[0].shutdown()
