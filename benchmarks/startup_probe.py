"""What every process ``benchmarks/startup.py`` launches records of its own start: a trace of (label, start, end)
events on the wall clock (``time.time()``, so that the launcher's, the torchrun agent's and the workers' events
line up), written to ``$DUFU_STARTUP_TRACE/<role>.json`` (role: ``single``, ``launcher`` or ``rank<R>``).

The process's entry (``startup.py --worker``) records its first line and its imports here; the Trainer's part
comes from :class:`StartupTrace`, a hook the job's config attaches (``train.hooks``): at ``on_start`` the
runtime's own start-up profile (``trainer.runtime.startup``: plan, model build, process group, precision,
teacher, optimizer, in seconds) and the moment the loop starts, then every step from ``on_step_start`` to
``after_optimizer``. Once every rank has finished step ``$DUFU_STARTUP_STEPS`` (default 1) the job ends there
(a barrier, then ``os._exit``): the rest of the run is not what is measured.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dufu.engine.hooks import Hook

TRACE_ENV, LAUNCH_ENV, STEPS_ENV = "DUFU_STARTUP_TRACE", "DUFU_STARTUP_LAUNCHED", "DUFU_STARTUP_STEPS"
# This process's trace: who it is, when it was launched and reached its first line, what it did when.
STATE: dict = {"role": None, "launched": None, "first_line": None, "events": [], "extra": {}}


def event(label: str, t0: float, t1: float) -> None:
    STATE["events"].append((label, t0, t1))


def write_trace(**extra) -> None:
    data = {"role": STATE["role"], "pid": os.getpid(), "first_line": STATE["first_line"],
            "launched": STATE["launched"], "events": STATE["events"], **STATE["extra"], **extra}
    Path(os.environ[TRACE_ENV], f"{STATE['role']}.json").write_text(json.dumps(data))


class StartupTrace(Hook):
    """The Trainer's start-up profile and its first steps, into this process's trace (module docstring)."""

    def __init__(self):
        self.stop_after = int(os.environ.get(STEPS_ENV, "1"))
        self._t0 = 0.0

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
            os._exit(0)
