"""A torchrun worker: ``dufu train`` with every rank's own time in each training step recorded, to check the
logged throughput against. Each rank appends ``{"step": n, "seconds": s}`` lines to
``$DUFU_TEST_STEP_TIMES/rank<r>.jsonl`` as it goes (dufu ends its workers with ``os._exit``): ``s`` is the time
this rank spent in ``Trainer.train_step`` for step ``n``.

``DUFU_TEST_SLOW_RANK=r:seconds`` makes rank ``r`` sleep that long at the end of each of its steps, after the
step's last collective: a rank that finishes every step later than rank 0, as a last pipeline stage does."""

import json
import os
import sys
import time
from pathlib import Path

from dufu.cli import main
from dufu.engine.trainer import Trainer

_log = Path(os.environ["DUFU_TEST_STEP_TIMES"]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
_slow_rank, _, _slow_seconds = os.environ.get("DUFU_TEST_SLOW_RANK", "-1:0").partition(":")
_is_slow = int(_slow_rank) == int(os.environ.get("RANK", "0"))
_original = Trainer.train_step


def _timed(self, micro_batches):
    t0 = time.perf_counter()
    out = _original(self, micro_batches)
    if _is_slow:
        time.sleep(float(_slow_seconds))
    seconds = time.perf_counter() - t0
    with _log.open("a") as f:
        f.write(json.dumps({"step": self.step + 1, "seconds": seconds}) + "\n")
    return out


Trainer.train_step = _timed
sys.exit(main(sys.argv[1:]))
