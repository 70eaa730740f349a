"""`dufu slurm CONFIG [key=value ...] --nodes N --gpus-per-node G [--submit]`: write (and submit) the sbatch script of
a training run that Slurm may stop and start again: every attempt runs ``srun dufu train CONFIG ... --resume``, a
signal before the time limit makes the run save and exit 75, and the script requeues the job then.

How the signal reaches the training processes: ``--signal=B:USR1@S`` has Slurm signal the batch shell alone, S
seconds before the limit (without ``B:`` it signals the job's steps instead, and the script would not know). The
script runs the ``srun`` step in the background and waits for it; its USR1 trap passes the signal to ``srun``,
which forwards it to every task of the step (and Slurm's process tracking delivers it to the tasks' children: the
workers of a launcher per node). Each dufu process finishes its step, all save one checkpoint together, and they
exit with 75 (dufu.engine.resilience.preemption); on 75 the script runs ``scontrol requeue``, Slurm puts the job
back in the queue with the same id (``--requeue``), and the next attempt appends to the same log
(``--open-mode=append``) and resumes. A job cancelled with ``scancel`` (SIGTERM to everything) is not requeued.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from dufu.cli.config_args import load_train_config, parse_config_args
from dufu.errors import DufuError

SIGNAL_SECONDS = 120  # default: time for a step, a checkpoint and the exit before the limit


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dufu slurm",
        description="Write the sbatch script of a training run that saves and requeues itself before Slurm's time "
                    "limit, and with --submit submit it (docs/cluster.md).")
    parser.add_argument("config", nargs="?", default=None, help="a .py or .yaml config, or a packaged recipe name")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    parser.add_argument("--gpus-per-node", type=int, required=True, metavar="G",
                        help="GPUs per node, one process each; 0 for a CPU job (processes: --tasks-per-node)")
    parser.add_argument("--tasks-per-node", type=int, default=None, metavar="T",
                        help="CPU jobs (--gpus-per-node 0): processes per node (default 1)")
    parser.add_argument("--cpus-per-task", type=int, default=None, metavar="C",
                        help="CPUs per process (default: Slurm's on GPU jobs, 1 on CPU jobs)")
    parser.add_argument("--launcher-per-node", action="store_true",
                        help="one srun task per node running dufu's launcher (torchrun, its workers forked from one "
                             "import) instead of one task per process")
    parser.add_argument("--partition", default=None, help="sbatch --partition")
    parser.add_argument("--time", default=None, help="sbatch --time (e.g. 4:00:00 or 1-00:00:00)")
    parser.add_argument("--account", default=None, help="sbatch --account")
    parser.add_argument("--job-name", default=None, help="sbatch --job-name (default: dufu-CONFIG)")
    parser.add_argument("--output-dir", default=None, metavar="D",
                        help="the run's train.output_dir (default: the config's); the script and the job's log go "
                             "to D/slurm/")
    parser.add_argument("--signal-seconds", type=int, default=SIGNAL_SECONDS, metavar="S",
                        help=f"send USR1 S seconds before the time limit (default {SIGNAL_SECONDS}): the run saves "
                             "and the job requeues")
    parser.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                        help="another #SBATCH line, e.g. --sbatch=--qos=high (repeatable)")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.train_iter=100")
    args, config, overrides = parse_config_args(parser, argv, "slurm")
    job = JobSpec.from_args(args)
    cfg = load_train_config(config, overrides)  # a config error now, not after hours in the queue
    output_dir = Path(args.output_dir or cfg.train.output_dir).absolute()
    check_layout(cfg, job.nodes * job.procs_per_node)
    train_argv = ([config] if config else []) + overrides + [f"train.output_dir={output_dir}"]
    name = args.job_name or f"dufu-{Path(config or 'default').stem}"
    script = output_dir / "slurm" / "job.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(job_script(job, train_argv, output_dir, name, Path.cwd(), ["slurm", *argv]))
    script.chmod(0o755)
    log = output_dir / "slurm" / "%j.out"
    if not args.submit:
        print(f"wrote {script}\nsubmit it with: sbatch {shlex.quote(str(script))}\nits log: {log} (%j: the job id)")
        return 0
    job_id = submit(script)
    print(f"submitted job {job_id} ({script})\n"
          f"  watch:  squeue -j {job_id}\n"
          f"          tail -f {shlex.quote(str(log).replace('%j', job_id))}\n"
          f"  cancel: scancel {job_id}")
    return 0


class JobSpec:
    """The job's shape and sbatch options, checked."""

    def __init__(self, nodes: int, gpus_per_node: int, tasks_per_node: int | None, cpus_per_task: int | None,
                 launcher_per_node: bool, partition=None, time=None, account=None, signal_seconds=SIGNAL_SECONDS,
                 extra=()):
        if nodes < 1:
            raise DufuError(f"--nodes {nodes}: a job has at least one node.")
        if gpus_per_node < 0:
            raise DufuError(f"--gpus-per-node {gpus_per_node}: give the GPUs of each node, or 0 for a CPU job.")
        if gpus_per_node and tasks_per_node is not None and tasks_per_node != gpus_per_node:
            raise DufuError(f"--tasks-per-node {tasks_per_node} with --gpus-per-node {gpus_per_node}: a GPU job runs "
                            "one process per GPU; drop --tasks-per-node.")
        if tasks_per_node is not None and tasks_per_node < 1:
            raise DufuError(f"--tasks-per-node {tasks_per_node}: at least one process per node.")
        if signal_seconds < 1:
            raise DufuError(f"--signal-seconds {signal_seconds}: the run needs time to save before the limit.")
        limit = parse_time(time) if time else None
        if limit is not None and signal_seconds >= limit:
            raise DufuError(f"--signal-seconds {signal_seconds} with --time {time} ({limit} s): the signal would "
                            "come before the job starts; lower --signal-seconds or raise --time.")
        self.nodes, self.gpus_per_node, self.launcher_per_node = nodes, gpus_per_node, launcher_per_node
        self.procs_per_node = gpus_per_node or tasks_per_node or 1
        self.cpus_per_task = cpus_per_task if cpus_per_task is not None else (None if gpus_per_node else 1)
        self.partition, self.time, self.account = partition, time, account
        self.signal_seconds, self.extra = signal_seconds, list(extra)

    @classmethod
    def from_args(cls, args) -> "JobSpec":
        return cls(args.nodes, args.gpus_per_node, args.tasks_per_node, args.cpus_per_task, args.launcher_per_node,
                   args.partition, args.time, args.account, args.signal_seconds, args.sbatch)

    @property
    def task_cpus(self) -> int | None:
        """CPUs of one srun task: a process's, or, for a launcher per node, those of every process of its node."""
        if self.cpus_per_task is None:
            return None
        return self.cpus_per_task * (self.procs_per_node if self.launcher_per_node else 1)

    def srun_options(self) -> list[str]:
        """srun's own options: a step does not take the batch job's --cpus-per-task (Slurm 22.05 on), so it is
        given again; a launcher per node without one takes the node's CPUs, not the step's default of one."""
        cpus = self.task_cpus
        if cpus is None and self.launcher_per_node:
            return ["--kill-on-bad-exit=1", '--cpus-per-task="$SLURM_CPUS_ON_NODE"']
        return ["--kill-on-bad-exit=1"] + ([f"--cpus-per-task={cpus}"] if cpus is not None else [])

    def sbatch_options(self, name: str, output_dir: Path, cwd: Path) -> list[str]:
        tasks = 1 if self.launcher_per_node else self.procs_per_node
        cpus = self.task_cpus
        options = [f"--job-name={name}", f"--nodes={self.nodes}", f"--ntasks-per-node={tasks}"]
        if self.gpus_per_node:
            options.append(f"--gpus-per-node={self.gpus_per_node}")
        if cpus is not None:
            options.append(f"--cpus-per-task={cpus}")
        options += [f"--{key}={value}" for key, value in
                    (("partition", self.partition), ("time", self.time), ("account", self.account)) if value]
        # USR1 to the batch shell (B:), which passes it to the training step (the module docstring says why)
        options += [f"--signal=B:USR1@{self.signal_seconds}", "--requeue", "--open-mode=append",
                    f"--output={output_dir / 'slurm' / '%j.out'}", f"--chdir={cwd}"]
        return options + self.extra


def parse_time(text: str) -> int:
    """Slurm's time limit in seconds: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise DufuError(f"--time {text!r}: Slurm takes MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS or "
                        "DAYS-HOURS[:MINUTES[:SECONDS]], e.g. 4:00:00.")
    days, a, b, c = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        return ((int(days) * 24 + int(a)) * 60 + int(b or 0)) * 60 + int(c or 0)
    if c is not None:  # H:M:S
        return (int(a) * 60 + int(b)) * 60 + int(c)
    return int(a) * 60 + int(b or 0)  # M or M:S


def check_layout(cfg, world_size: int) -> None:
    """The config's parallel degrees fit the job's processes (ParallelDims' message), unless the planner chooses
    them at start-up (``auto``)."""
    from dufu.engine.schema import auto_layout_keys  # imports torch: not for --help
    from dufu.parallel.parallel_dims import ParallelDims

    if not auto_layout_keys(cfg):
        ParallelDims.from_config(cfg.train.dist, world_size)


def job_script(job: JobSpec, train_argv: list[str], output_dir: Path, name: str, cwd: Path, argv: list[str]) -> str:
    """The sbatch script's text."""
    from dufu.engine.resilience.preemption import PREEMPTED_EXIT_CODE  # imports torch: not for --help

    dufu = [sys.executable, "-m", "dufu"]  # the Python that wrote the script, whatever PATH the job has
    if job.launcher_per_node:
        train = [*dufu, "train", "--nproc", str(job.procs_per_node), *train_argv, "--resume"]
    else:
        train = [*dufu, "train", *train_argv, "--resume"]
    options = "\n".join(f"#SBATCH {o}" for o in job.sbatch_options(name, output_dir, cwd))
    mode = ("one task per node: dufu's launcher starts the node's processes through torchrun" if job.launcher_per_node
            else "one task per process: each reads RANK, WORLD_SIZE and LOCAL_RANK from Slurm")
    return f"""#!/bin/bash
# Written by: dufu {shlex.join(argv)}
# Submit: sbatch {shlex.quote(str(output_dir / 'slurm' / 'job.sbatch'))}
# {job.nodes} node(s) x {job.procs_per_node} process(es); {mode}.
# Every attempt continues from the run's newest complete checkpoint (--resume; the first starts at step 0).
# {job.signal_seconds} s before the time limit Slurm sends USR1 to this shell (B:); the trap passes it to srun,
# which forwards it to the training processes: they finish their step, save a checkpoint and exit
# {PREEMPTED_EXIT_CODE}, and this script requeues the job. Any other exit code ends the job with it (scancel ends it
# without a requeue).
{options}

set -u
echo "dufu: job ${{SLURM_JOB_ID}} attempt $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) on ${{SLURM_JOB_NODELIST}} at $(date)"
srun {" ".join(job.srun_options())} {shlex.join(train)} &
step=$!
trap 'echo "dufu: USR1: the run saves a checkpoint and stops"; kill -USR1 "$step"' USR1
# a trapped signal ends `wait` early: wait again while the step runs, then take its exit code
while kill -0 "$step" 2>/dev/null; do wait "$step"; done
wait "$step"; code=$?
if [ "$code" -eq {PREEMPTED_EXIT_CODE} ]; then
    echo "dufu: the run saved a checkpoint and stopped (exit {PREEMPTED_EXIT_CODE}): requeueing job ${{SLURM_JOB_ID}}"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
"""


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT`` -> the job id."""
    if shutil.which("sbatch") is None:
        raise DufuError(f"sbatch is not on PATH: this is no Slurm login node. The script is written; submit it "
                        f"where Slurm is: sbatch {script}")
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DufuError(f"sbatch refused {script} (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    return proc.stdout.strip().split(";")[0]  # "JOBID" or "JOBID;CLUSTER"
