"""Helpers for the checkpoint and fault-handling tests: real `dufu train` processes, run in the background.

Every run here is `python -m dufu train ...` in a subprocess (through dufu's own torchrun launcher for
``--nproc N``), started by tests/launch.py, because what is tested is what a user sees: exit codes, messages,
files on disk. The
runs are expensive on a small CPU machine, so a :class:`JobPool` starts them in the background as soon
as the session knows it needs them (at most ``DUFU_TEST_JOBS``, default 2, at a time), respecting
dependencies (a resume needs the run it resumes); a test then waits for the result it needs.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from launch import REPO, Proc, assert_ok, run, stop_all, train_command  # noqa: F401  (the tests import them here)
from parity import assert_losses_match, consolidated_state, records, train_records  # noqa: F401

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
    from dufu.engine.checkpoint import Checkpointer

    ckpt = Path(ckpt)
    checkpointer = Checkpointer(ckpt.parent)
    if group == "model":
        return checkpointer.consolidated_model_state(ckpt)
    import warnings

    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dufu.engine.checkpoint import SafeFileSystemReader, SafeLoadPlanner

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


@dataclass
class _Job:
    name: str
    fn: Callable
    deps: tuple[str, ...]
    state: str = "defined"  # defined -> queued -> running -> done | failed
    result: object = None
    error: Optional[BaseException] = None
    done: threading.Event = field(default_factory=threading.Event)


class JobPool:
    """Background jobs with dependencies; at most ``max_running`` at a time, in queue order.

    ``define(name, fn, deps)``: ``fn(pool)`` runs in a thread once every dependency is done (it reads them
    with ``pool.result(dep)``). ``want(names)`` queues jobs (and their dependencies) in that order;
    ``result(name)`` moves a job to the front of the queue and waits for it."""

    def __init__(self, max_running: int = 2):
        self.max_running = max(1, max_running)
        self.jobs: dict[str, _Job] = {}
        self.queue: list[str] = []
        self.lock = threading.Lock()
        self.running = 0

    def define(self, name: str, fn: Callable, deps: tuple[str, ...] = ()) -> None:
        self.jobs[name] = _Job(name, fn, tuple(deps))

    def _closure(self, name: str) -> list[str]:
        out = []
        for dep in self.jobs[name].deps:
            out += self._closure(dep)
        return out + [name]

    def want(self, names, front: bool = False) -> None:
        with self.lock:
            order = []
            for n in names:
                for m in self._closure(n):
                    if m not in order:
                        order.append(m)
            for m in order:
                job = self.jobs[m]
                if job.state == "defined":
                    job.state = "queued"
                    self.queue.append(m)
                if front and job.state == "queued":
                    self.queue.remove(m)
            if front:
                self.queue[:0] = [m for m in order if self.jobs[m].state == "queued"]
            self._pump()

    def _pump(self) -> None:  # with self.lock held
        changed = True
        while changed:
            changed = False
            for name in list(self.queue):
                job = self.jobs[name]
                deps = [self.jobs[d] for d in job.deps]
                if any(d.state == "failed" for d in deps):
                    self.queue.remove(name)
                    job.state, job.error = "failed", JobFailed(f"{name}: a job it needs failed")
                    job.done.set()
                    changed = True
                elif all(d.state == "done" for d in deps) and self.running < self.max_running:
                    self.queue.remove(name)
                    job.state = "running"
                    self.running += 1
                    threading.Thread(target=self._run, args=(job,), name=f"job-{name}", daemon=True).start()

    def _run(self, job: _Job) -> None:
        try:
            job.result = job.fn(self)
            state = "done"
        except BaseException as e:  # reported to whoever waits for the job
            job.error = e
            state = "failed"
        with self.lock:
            job.state = state
            self.running -= 1
            job.done.set()
            self._pump()

    def shutdown(self) -> None:
        """Start nothing more, and end the runs in progress."""
        with self.lock:
            for name in self.queue:
                job = self.jobs[name]
                job.state, job.error = "failed", JobFailed(f"{name}: the test session ended")
                job.done.set()
            self.queue.clear()
        stop_all()

    def result(self, name: str):
        self.want([name], front=True)
        job = self.jobs[name]
        job.done.wait()
        if job.error is not None:
            if isinstance(job.error, JobFailed):
                raise job.error
            raise JobFailed(f"{name} failed: {job.error!r}") from job.error
        return job.result
