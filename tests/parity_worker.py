"""Several ``dufu train`` runs one after another in the same processes (tests/parity.py's SharedRuns).

    python tests/launch.py --nproc N tests/parity_worker.py PLAN.json train.output_dir=JOB   (N workers)
    python tests/parity_worker.py PLAN.json train.output_dir=JOB                             (one process)

PLAN.json lists runs ``{"name", "output_dir", "config", "args", "env", "resume_of"}``. Every worker runs each of
them through ``dufu.cli.main(["train", CONFIG, *ARGS, "train.output_dir=OUTPUT_DIR"])``, as a worker of
``dufu train --nproc N`` does, with ``env`` set while it runs; a run with ``resume_of`` (an earlier run's output
directory) starts from a copy of that directory, with ``--resume``. Between runs the workers meet at a barrier
instead of leaving (``finish_distributed`` ends a worker's process). tests/launch.py's in_turn marks each run
done in ``JOB/.done/NAME``; the first that fails ends the job, its traceback in ``JOB/.failed/NAME.rank<R>``.

The command-line argument ``train.output_dir=JOB`` is not read as an override: it names the job's directory and
marks the workers as the job's for tests/launch.py, which ends them with the job.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

import dufu.parallel.launch as dufu_launch
from dufu.cli import main as dufu
from dufu_testing import environment
from launch import in_turn


def between_runs(exit_code: int = 0) -> None:
    """What the runs call instead of ``finish_distributed`` (which ends the process): every rank is done."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()


def copy_of(source: str, dest: Path, timeout: float = 600) -> None:
    """Rank 0 copies ``source`` to ``dest`` (whole, under another name first); the other ranks wait for it."""
    if os.environ.get("RANK", "0") == "0":
        partial = dest.with_name(dest.name + ".copying")
        shutil.copytree(source, partial)
        partial.rename(dest)
    deadline = time.monotonic() + timeout
    while not dest.exists():
        assert time.monotonic() < deadline, f"{dest} was not copied from {source} within {timeout:.0f} s"
        time.sleep(0.05)


def main(plan_file: str, job: str) -> None:
    runs = {run["name"]: run for run in json.loads(Path(plan_file).read_text())}
    finish, dufu_launch.finish_distributed = dufu_launch.finish_distributed, between_runs

    def train(name: str) -> None:
        run = runs[name]
        print(f"\n===== {time.strftime('%H:%M:%S')} {name}: dufu train {run['config']} {' '.join(run['args'])}",
              flush=True)
        resume = []
        if run["resume_of"]:
            copy_of(run["resume_of"], Path(run["output_dir"]))
            resume = ["--resume"]
        with environment(run["env"]):
            code = dufu(["train", run["config"], *resume, *run["args"], f"train.output_dir={run['output_dir']}"])
        assert code == 0, f"dufu train exited with {code}"

    in_turn(job, list(runs), train)
    finish(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split("=", 1)[1])
