"""Stop signals: SIGTERM (what SLURM and Kubernetes send before they kill a job), SIGUSR1 (SLURM's
``--signal=USR1@SECONDS``) or SIGINT (Ctrl-C) makes every rank finish its current step, save a checkpoint and stop;
a second Ctrl-C stops at once.

* **Workers** (:class:`Preemption`): a handler only records the signal; the training loop asks
  :meth:`Preemption.requested` after every step, and the ranks agree on the answer (a MAX all-reduce of one
  number over a gloo group), since a signal reaches the ranks at slightly different times, or only some of them.
  The loop then stops as it does for ``train.stop_at_iter``: a complete checkpoint of the step just finished,
  the end summary saying how to continue (:func:`resume_command`), and rank 0 writes ``preempted.json`` (step,
  signal) into the run directory. The process exits with :func:`exit_code`: :data:`PREEMPTED_EXIT_CODE` after a
  scheduler's signal (requeue the job), :data:`INTERRUPTED_EXIT_CODE` after Ctrl-C (a person stopped the run: a
  shell, or a job script's requeue loop, must not take it for a preemption and start it again).
* **A second stop** (:func:`abandons`): a SIGINT after any stop signal, or any stop signal after a SIGINT, ends
  the process at once (``os._exit``, :data:`INTERRUPTED_EXIT_CODE`), saying that the checkpoint in progress was
  abandoned and naming the last complete one, which is intact: a checkpoint is written under a temporary name
  and renamed only when every rank has finished it (dufu.engine.weights.checkpoint). Repeated scheduler signals
  (SIGTERM, SIGUSR1) do not abandon the save they asked for.
* **The launcher** (``dufu train --nproc``) runs torchrun's agent, which on SIGTERM and SIGINT (and, told by
  ``TORCHELASTIC_SIGNALS_TO_HANDLE``, on SIGUSR1) passes the signal on to its workers and waits
  ``--shutdown-timeout`` seconds (``train.preemption.grace_seconds``) before it kills them. Its workers run in
  sessions of their own (torchrun starts them so), so a terminal's Ctrl-C reaches them only through the agent:
  the first as SIGINT; a second one interrupts the agent's wait, and it stops the workers with SIGTERM, which
  after a SIGINT abandons the save. When the workers left ``preempted.json`` behind, the launcher exits with
  :func:`exit_code` of its signal.

The next ``dufu train ... --resume`` continues with exactly the losses of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry": a scheduler's requeue.
PREEMPTED_EXIT_CODE = 75
# 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C.
INTERRUPTED_EXIT_CODE = 128 + int(signal.SIGINT)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
MARKER = "preempted.json"


def exit_code(signal_name: str) -> int:
    """The exit code of a run that stopped with a complete checkpoint because of ``signal_name``."""
    return INTERRUPTED_EXIT_CODE if signal_name == signal.SIGINT.name else PREEMPTED_EXIT_CODE


def abandons(first: int, then: int) -> bool:
    """Whether signal ``then``, arriving after ``first`` asked for a save, stops the process at once."""
    return signal.SIGINT in (first, then)


class Preemption:
    """Records SIGTERM / SIGUSR1 / SIGINT in this process, and ends it at a second stop (see the module
    docstring). Handlers can only be installed from the main thread; elsewhere (a trainer built in a helper
    thread) the signals are simply not watched. ``checkpointer`` (dufu.engine.weights.checkpoint.Checkpointer):
    the run's checkpoints, so that a second stop can name the last complete one and the command that continues
    from it; without it the message can only point at the run's checkpoints directory."""

    def __init__(self, enabled: bool = True, checkpointer=None):
        self.signal: Optional[int] = None
        self.enabled = enabled
        self.checkpointer = checkpointer
        self.previous = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            if signum == signal.SIGINT:
                _say("\ndufu: Ctrl-C (SIGINT): finishing this step, then saving a checkpoint and stopping. Press "
                     "Ctrl-C again to stop at once, without that checkpoint.\n")
        elif abandons(self.signal, signum):
            self._stop_now(signum)

    def _stop_now(self, signum: int) -> None:
        """End this process at once (a signal handler, in the main thread: the save in progress is abandoned)."""
        for stream in (sys.stdout, sys.stderr):  # what the run printed before, e.g. its last logged step
            try:
                stream.flush()
            except (OSError, RuntimeError, ValueError):  # RuntimeError: the handler interrupted a write to it
                pass
        first = signal.Signals(self.signal).name
        _say(f"\ndufu: a second stop signal ({signal.Signals(signum).name} after {first}): stopped at once; the "
             f"checkpoint being saved (if any) was abandoned. {self._intact()}\n")
        os._exit(INTERRUPTED_EXIT_CODE)

    def _intact(self) -> str:
        if self.checkpointer is None:
            return ("Complete checkpoints in the run's checkpoints directory are intact (a checkpoint is renamed "
                    "to step_NNNNNNN only once it is complete); continue with --resume.")
        latest = self.checkpointer.latest()
        again = resume_command_here(Path(self.checkpointer.root).parent)
        if latest is None:
            return f"No checkpoint was complete yet; {again} starts the run again from step 0."
        return f"The last complete checkpoint, {latest}, is intact; continue from it with: {again}"

    def requested(self, group=None, world_size: int = 1) -> Optional[str]:
        """The name of the signal that asked this job to stop, agreed by all ranks (every rank calls this at the
        same step), or None. The agreement is one number all-reduced over a gloo group (a CPU tensor): the
        hosts meet, but no device is waited for. Nothing is exchanged when preemption is off."""
        if not self.enabled:
            return None
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


def _say(text: str) -> None:
    """Write to stderr from a signal handler (one process per job: rank 0's). ``os.write``, since the handler
    may have interrupted a ``print`` to the same buffered stream."""
    if os.environ.get("RANK", "0") == "0":
        try:
            os.write(2, text.encode())
        except OSError:
            pass


def resume_command(output_dir, nproc: Optional[int] = None, launcher_args: Sequence[str] = ()) -> str:
    """``dufu train OUTPUT_DIR/config.yaml [--nproc N LAUNCHER_ARGS] --resume``: the command line that continues
    a run from its last complete checkpoint (the run's ``config.yaml`` alone reproduces it). ``nproc``: the
    processes per node of a run started with ``dufu train --nproc N``; ``launcher_args``: its other launcher
    options (``--nnodes 2``, ``--master-addr node0`` ...), as they were given."""
    cmd = ["dufu", "train", str(Path(output_dir) / "config.yaml")]
    if nproc is not None:
        cmd += ["--nproc", str(nproc), *launcher_args]
    elif launcher_args:
        raise ValueError(f"launcher options {list(launcher_args)} without nproc: they belong to `dufu train --nproc`")
    return shlex.join([*cmd, "--resume"])


def resume_command_here(output_dir, environ=None) -> str:
    """:func:`resume_command` as this process sees its job: one process, or a torchrun worker (``--nproc`` is
    torchrun's ``LOCAL_WORLD_SIZE``). A job of several nodes is started again on every node with the options it
    was started with, which a worker does not know: the command then says so."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env:
        world = int(env.get("WORLD_SIZE", "1") or 1)
        if env.get("SLURM_STEP_ID") is not None and world > 1:  # srun's tasks, one process each (dufu.parallel.slurm)
            return (f"srun --ntasks={world} --ntasks-per-node={env.get('LOCAL_WORLD_SIZE', world)} "
                    f"{resume_command(output_dir)}")
        return resume_command(output_dir)
    nnodes = int(env.get("GROUP_WORLD_SIZE", "1") or 1)
    cmd = resume_command(output_dir, int(env["LOCAL_WORLD_SIZE"]), ["--nnodes", str(nnodes)] if nnodes > 1 else [])
    return cmd if nnodes == 1 else f"{cmd} (on each node, with its --node-rank and the job's rendezvous options)"


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
