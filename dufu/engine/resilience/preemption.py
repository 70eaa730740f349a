"""Preemption: SIGTERM (what SLURM and Kubernetes send before they kill a job) or SIGUSR1 (SLURM's
``--signal=USR1@SECONDS``) makes every rank finish its current step, save a checkpoint and stop.

* **Workers** (:class:`Preemption`): a handler only records the signal; the training loop asks
  :meth:`Preemption.requested` after every step, and the ranks agree on the answer (a MAX all-reduce of one
  number over a gloo group), since a signal reaches the ranks at slightly different times, or only some of them.
  The loop then stops as it does for ``train.stop_at_iter``: a complete checkpoint of the step just finished,
  the end summary saying how to continue, and rank 0 writes ``preempted.json`` (step, signal) into the run
  directory. The process exits with :data:`PREEMPTED_EXIT_CODE`.
* **The launcher** (``dufu train --nproc``) runs torchrun's agent, which on SIGTERM (and, told by
  ``TORCHELASTIC_SIGNALS_TO_HANDLE``, on SIGUSR1) passes the signal to its workers and waits
  ``--shutdown-timeout`` seconds (``train.preemption.grace_seconds``) before it kills them. When the workers
  left ``preempted.json`` behind, the launcher exits with :data:`PREEMPTED_EXIT_CODE` too.

The next ``dufu train ... --resume`` continues with exactly the losses of an uninterrupted run.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry": a scheduler's requeue.
PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
MARKER = "preempted.json"


class Preemption:
    """Records SIGTERM / SIGUSR1 in this process (see the module docstring). Handlers can only be installed from
    the main thread; elsewhere (a trainer built in a helper thread) preemption is simply not watched."""

    def __init__(self, enabled: bool = True):
        self.signal: Optional[int] = None
        self.previous = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.signal = signum

    def requested(self, group=None, world_size: int = 1) -> Optional[str]:
        """The name of the signal that asked this job to stop, agreed by all ranks (every rank calls this at the
        same step), or None."""
        code = float(self.signal or 0)
        if world_size > 1:
            mine = torch.tensor([code])  # gloo group: a CPU tensor
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
            code = mine.item()
        return signal.Signals(int(code)).name if code else None

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def write_marker(output_dir, step: int, signal_name: str) -> None:
    Path(output_dir, MARKER).write_text(json.dumps({"step": step, "signal": signal_name}) + "\n")


def read_marker(output_dir) -> Optional[dict]:
    """What a preempted run left in ``output_dir``, or None."""
    path = Path(output_dir, MARKER)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def clear_marker(output_dir) -> None:
    Path(output_dir, MARKER).unlink(missing_ok=True)
