"""Several ``dufu train`` runs one after another in the same processes (tests/parity.py's SharedRuns).

    python tests/parity_worker.py --nproc N PLAN.json train.output_dir=JOB   (N workers, forked as dufu's are)
    python tests/parity_worker.py PLAN.json train.output_dir=JOB             (one process)

With ``--nproc N`` this process is the launcher: torchrun's agent in it (dufu.cli.torchrun.launch_forked) forks
the N workers from dufu's worker server, exactly as ``dufu train --nproc N`` does, and each runs :func:`forked`.

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


def forked(plan_file: str, job: str, launcher_env: dict, cwd: str, agent_pid: int) -> None:
    """A worker of ``--nproc N``: a forked process made a torchrun worker (dufu.cli.workers.become_worker)."""
    from dufu.cli.workers import become_worker

    become_worker(launcher_env, cwd, agent_pid)
    main(plan_file, job)


def launch(nproc: int, plan_file: str, job: str) -> int:
    """Start ``nproc`` workers running :func:`forked` as ``dufu train --nproc`` starts its own; the exit code."""
    from torch.distributed.run import parse_args

    import parity_worker  # this file as a module: the entrypoint the forked workers import by name
    from dufu.cli.torchrun import launch_forked
    from dufu.cli.workers import launch_state, start_worker_server

    start_worker_server(nproc)
    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", sys.argv[0]])
    try:
        launch_forked(args, parity_worker.forked, plan_file, job, *launch_state())
    except Exception:  # noqa: BLE001 - a failed worker: torchrun's report, then the job's exit code
        import traceback

        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--nproc":
        sys.exit(launch(int(sys.argv[2]), sys.argv[3], sys.argv[4].split("=", 1)[1]))
    main(sys.argv[1], sys.argv[2].split("=", 1)[1])
