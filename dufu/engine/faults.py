"""Fault injection for testing dufu's fault handling with real processes.

``DUFU_FAULT`` holds comma-separated faults, each ``kind:rank:step``:

* ``exit:R:S``          rank R exits with status 1 at the start of step S (a crashed worker)
* ``hang:R:S``          rank R sleeps forever at the start of step S (a hung worker)
* ``kill_in_save:R:S``  rank R SIGKILLs its whole job in the middle of writing the step-S checkpoint
                        (after the shards are written, before the checkpoint is committed)
* ``nan:R:S``           rank R's loss becomes NaN at step S

A rank of ``*`` means every rank. Faults fire only in the first attempt of an elastic job
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted job runs clean.
"""

from __future__ import annotations

import os
import signal
import time


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
    if should_fire("hang", step):
        while True:
            time.sleep(3600)


def in_save(step: int) -> None:
    if should_fire("kill_in_save", step):
        # kill -9 the whole job: this process and its torchrun agent, if any
        parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        if parent:
            os.kill(parent, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
