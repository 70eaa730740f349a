"""Helpers for the checkpoint and fault-handling tests: real `dufu train` processes, run in the background.

Every run here is `python -m dufu train ...` in a subprocess (through dufu's own torchrun launcher for
``--nproc N``), started by tests/launch.py, because what is tested is what a user sees: exit codes, messages,
files on disk. The
runs are expensive on a small CPU machine, so a :class:`JobPool` starts them in the background as soon
as the session knows it needs them (at most ``DUFU_TEST_JOBS``, default 2, at a time, on a thread pool),
respecting dependencies (a resume needs the run it resumes); a test then waits for the result it needs.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from launch import Proc, stop_all

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
