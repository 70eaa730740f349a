"""Fault injection for testing dufu's fault handling with real processes.

``DUFU_FAULT`` holds comma-separated faults, each ``kind:rank:step``:

* ``exit:R:S``          rank R exits with status 1 at the start of step S (a crashed worker)
* ``hang:R:S``          rank R sleeps forever at the start of step S (a hung worker)
* ``kill_in_save:R:S``  rank R SIGKILLs its whole job in the middle of writing the step-S checkpoint
                        (after the shards are written, before the checkpoint is committed)
* ``hang_in_save:R:S``  rank R sleeps forever at that point of every checkpoint from step S on (a save that a
                        second Ctrl-C abandons)
* ``nan:R:S``           rank R's loss becomes NaN at step S
* ``kill:R:S``          rank R is killed with SIGKILL at the start of step S (a lost process)
* ``kill_node:R:S``     rank R SIGKILLs its torchrun agent and itself at the start of step S (a lost node: the
                        node's other workers are left without their agent and stop at the collective timeout)
* ``slow:R:S``          rank R sleeps 0.1 s at the start of every step from step S on (a straggler; lets a test
                        restart a replica group while this one is still training)
* ``term:R:S``, ``usr1:R:S``  rank R sends SIGTERM / SIGUSR1 to its job at the start of step S, as a scheduler
                        preempting it would: to its torchrun agent (the launcher) if it has one, else to itself

A rank of ``*`` means every rank. Faults fire only in the first attempt of an elastic job
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted job runs clean.

The trainer's faults come in as a hook of its loop (:func:`training_faults`): the loop and its step carry no test
code.
"""

from __future__ import annotations

import os
import signal
import time

from dufu.engine.hooks import Hook
from dufu.parallel.env import agent_pid

TRAINING_FAULTS = ("exit", "kill", "kill_node", "hang", "nan", "term", "usr1", "slow")


def _faults() -> list[tuple[str, str, int]]:
    spec = os.environ.get("DUFU_FAULT", "").strip()
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return []
    out = []
    for item in spec.split(","):
        kind, rank, step = item.strip().split(":")
        out.append((kind, rank, int(step)))
    return out


def should_fire(kind: str, step: int) -> bool:
    rank = os.environ.get("RANK", "0")
    return any(k == kind and s == step and r in ("*", rank) for k, r, s in _faults())


def at_step_start(step: int) -> None:
    if should_fire("exit", step):
        os._exit(1)
    if should_fire("kill", step):
        os.kill(os.getpid(), signal.SIGKILL)
    if should_fire("kill_node", step):
        if "TORCHELASTIC_RUN_ID" in os.environ:
            os.kill(agent_pid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    rank = os.environ.get("RANK", "0")
    if any(k == "slow" and step >= s and r in ("*", rank) for k, r, s in _faults()):
        time.sleep(0.1)
    if should_fire("hang", step):
        while True:
            time.sleep(3600)
    for kind, sig in (("term", signal.SIGTERM), ("usr1", signal.SIGUSR1)):
        if should_fire(kind, step):
            os.kill(agent_pid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), sig)


def in_save(step: int) -> None:
    if should_fire("kill_in_save", step):
        # kill -9 the whole job: this process and its torchrun agent, if any
        parent = agent_pid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        if parent:
            os.kill(parent, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    rank = os.environ.get("RANK", "0")
    if any(k == "hang_in_save" and step >= s and r in ("*", rank) for k, r, s in _faults()):
        while True:
            time.sleep(3600)


class TrainingFaults(Hook):
    """The training faults ``DUFU_FAULT`` names, as a hook of the loop: ``exit``, ``kill``, ``kill_node``, ``hang``,
    ``slow``, ``term`` and ``usr1`` as a step starts; ``nan`` after the step's backward (the first gradient and the
    loss become NaN on that rank only, after any gradient reduction, as a local overflow would)."""

    def on_step_start(self, trainer) -> None:
        at_step_start(trainer.step + 1)

    def after_backward(self, trainer, local_loss):
        if not should_fire("nan", trainer.step + 1):
            return None
        for part in trainer.model_parts:
            for p in part.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
                    break
        return local_loss * float("nan")


def training_faults():
    """The :class:`TrainingFaults` hook when ``DUFU_FAULT`` names a training fault, else None."""
    if not any(kind in TRAINING_FAULTS for kind, _, _ in _faults()):
        return None
    return TrainingFaults()
