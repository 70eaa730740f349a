"""What every process ``benchmarks/startup.py`` launches records of its own start: a trace of (label, start, end)
events on the wall clock (``time.time()``, so that the launcher's, the worker server's and the workers' events
line up), written to ``$DUFU_STARTUP_TRACE/<role>.json`` (role: ``single``, ``launcher`` or ``rank<R>``).

A process started as a new interpreter runs ``startup.py --worker``, which records its first line and its imports
here. A worker forked from dufu's worker server (``dufu train --nproc N`` since ff13f52) runs none of that file:
:class:`StartupTrace` fills in its trace when the Trainer makes it (its start is its fork: the kernel's start time
of its process). This module is then also the last module the worker server imports before it forks any worker
(``startup.py`` appends it to ``dufu.cli.workers.PRELOAD``): :data:`IMPORTED_AT` is when that import ended, in the
server, and every worker forked from it inherits the value, with :data:`IMPORTED_PID`, the server's pid.

The Trainer's part comes from :class:`StartupTrace`, a hook the job's config attaches (``train.hooks``): at
``on_start`` the runtime's own start-up profile (``trainer.runtime.startup``: plan, model build, process group,
precision, teacher, optimizer, in seconds) and the moment the loop starts, then every step from ``on_step_start``
to ``after_optimizer``. Once every rank has finished step ``$DUFU_STARTUP_STEPS`` (default 1) the job ends there
(a barrier, then the process ends): the rest of the run is not what is measured.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

from dufu.engine.hooks import Hook

# When and where this module was imported: in a forked worker whose pid differs from IMPORTED_PID, the worker
# server's import of it, the last of its preload (see the module docstring).
IMPORTED_AT, IMPORTED_PID = time.time(), os.getpid()

TRACE_ENV, LAUNCH_ENV, STEPS_ENV = "DUFU_STARTUP_TRACE", "DUFU_STARTUP_LAUNCHED", "DUFU_STARTUP_STEPS"
# This process's trace: who it is, when it was launched and reached its first line, what it did when.
STATE: dict = {"role": None, "launched": None, "first_line": None, "events": [], "extra": {}}


def event(label: str, t0: float, t1: float) -> None:
    STATE["events"].append((label, t0, t1))


def write_trace(**extra) -> None:
    data = {"role": STATE["role"], "pid": os.getpid(), "first_line": STATE["first_line"],
            "launched": STATE["launched"], "events": STATE["events"], **STATE["extra"], **extra}
    Path(os.environ[TRACE_ENV], f"{STATE['role']}.json").write_text(json.dumps(data))


def forked_worker() -> None:
    """The trace of a worker forked from dufu's worker server (not started through ``startup.py --worker``): its
    rank, its start (the fork, from ``/proc/self/stat``), no first line or imports of its own, and the server's
    start and the end of its imports, when this module was imported there."""
    if multiprocessing.parent_process() is None or "RANK" not in os.environ:
        raise RuntimeError("StartupTrace in a process that benchmarks/startup.py did not start: run the benchmark")
    import dufu
    from harness import proc

    STATE.update(role=f"rank{os.environ['RANK']}", launched=proc.process_start_time(), first_line=None)
    STATE["extra"].update(start="fork", dufu=str(Path(dufu.__file__).parent))
    if IMPORTED_PID != os.getpid():  # imported in the server, which forked this process
        STATE["extra"]["worker_server"] = {"pid": IMPORTED_PID, "parent": IMPORTED_PID == os.getppid(),
                                           "started": proc.process_start_time(IMPORTED_PID),
                                           "preloaded": IMPORTED_AT}


class StartupTrace(Hook):
    """The Trainer's start-up profile and its first steps, into this process's trace (module docstring)."""

    def __init__(self):
        self.stop_after = int(os.environ.get(STEPS_ENV, "1"))
        self._t0 = 0.0
        if STATE["role"] is None:
            forked_worker()

    def on_start(self, trainer) -> None:
        now = time.time()
        STATE["extra"]["runtime_startup"] = dict(trainer.runtime.startup)
        event("loop start", now, now)

    def on_step_start(self, trainer) -> None:
        self._t0 = time.time()

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        step = trainer.step + 1
        event(f"step {step}", self._t0, time.time())
        if step == self.stop_after:  # every rank gets here: end the job without the rest of the run
            import torch.distributed as dist

            write_trace()
            if dist.is_initialized():
                dist.barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            if STATE["extra"].get("start") == "fork":
                # torchrun's agent waits for a forked worker's function to return (its return value), and would
                # wait forever for one that ended itself; SystemExit(0) unwinds to dufu's worker function, which
                # returns, and multiprocessing ends the process with os._exit
                raise SystemExit(0)
            os._exit(0)
