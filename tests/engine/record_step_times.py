"""A torchrun worker: ``dufu train`` with every rank's own time in each training step recorded, to check the
logged throughput against. Each rank appends ``{"step": n, "seconds": s}`` lines to
``$DUFU_TEST_STEP_TIMES/rank<r>.jsonl`` as it goes (dufu ends its workers with ``os._exit``): ``s`` is the time
this rank spent in step ``n``, from the step's start to the end of its optimizer step (a training-loop hook,
:class:`StepTimes`, attached through ``train.hooks``).

``DUFU_TEST_SLOW_RANK=r:seconds`` makes rank ``r`` sleep that long at the end of each of its steps, after the
step's last collective: a rank that finishes every step later than rank 0, as a last pipeline stage does."""

import json
import os
import sys
import time
from pathlib import Path

from dufu.cli import main
from dufu.engine.hooks import Hook


class StepTimes(Hook):
    def __init__(self):
        self.log = Path(os.environ["DUFU_TEST_STEP_TIMES"]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
        slow_rank, _, slow_seconds = os.environ.get("DUFU_TEST_SLOW_RANK", "-1:0").partition(":")
        self.sleep = float(slow_seconds) if int(slow_rank) == int(os.environ.get("RANK", "0")) else 0.0
        self.t0 = None

    def on_step_start(self, trainer) -> None:
        self.t0 = time.perf_counter()

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        if self.sleep:
            time.sleep(self.sleep)
        seconds = time.perf_counter() - self.t0
        with self.log.open("a") as f:
            f.write(json.dumps({"step": trainer.step + 1, "seconds": seconds}) + "\n")


if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], 'train.hooks=[{"_target_": "__main__.StepTimes"}]']))
