"""Starting the training jobs a benchmark measures, and reading what they logged.

A job is ``dufu train`` as a user starts it (``python -m dufu train ...``, or its torchrun workers directly), in
a session of its own (a hung job is stopped whole), with its output in one folder. Its environment is the
benchmark's own minus what must not leak into a job (a parent's torchrun variables, malloc settings, another
job's records), plus one dufu cache, the OpenMP threads and ``PYTHONPATH`` with this checkout and
``benchmarks/``: a benchmark attaches hook objects to the job's Trainer through ``train.hooks``
(:func:`hooks_override`), which the workers import from there (:mod:`harness.hooks`, :mod:`harness.memory`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
# What a job must not inherit: a parent torchrun's world, malloc tuning and record folders of another job.
PRIVATE_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "MALLOC_MMAP_THRESHOLD_",
               "MALLOC_TRIM_THRESHOLD_")


@dataclass
class Run:
    """One job: its command, environment and folder (``out``, holding ``run.log``), and how it went."""

    label: str
    cmd: list[str]
    env: dict
    out: Path
    rc: int | None = None
    seconds: float = 0.0
    load_before: float = 0.0
    log_tail: str = ""
    extra: dict = field(default_factory=dict)


def execute(run: Run, timeout: float, cwd: Path = REPO) -> Run:
    """Run one job in its own session (so a hung job can be stopped completely), output to ``out/run.log``."""
    run.out.mkdir(parents=True, exist_ok=True)
    log = run.out / "run.log"
    run.load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(run.cmd, stdout=f, stderr=subprocess.STDOUT, env=run.env, cwd=cwd,
                                start_new_session=True)
        try:
            run.rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session of the job this benchmark started, nothing else
            proc.wait()
            run.rc = -9
            f.write(f"\n[benchmark] killed after {timeout:.0f} s\n")
        except BaseException:  # Ctrl-C: the job runs in its own session and would not see it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    run.seconds = time.perf_counter() - t0
    if run.rc != 0:
        run.log_tail = log.read_text(errors="replace")[-3000:]
    return run


def pythonpath(*first: str | Path) -> str:
    """``first``, then this checkout and ``benchmarks/`` (dufu, and the hooks ``train.hooks`` names), then the
    caller's ``PYTHONPATH``."""
    parts = [str(p) for p in first] + [str(REPO), str(BENCH), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def job_env(cache: Path | None = None, threads: int | None = 1, extra: dict | None = None,
            code: Path | None = None) -> dict:
    """The environment of a job: this one's without :data:`PRIVATE_ENV`, with ``DUFU_CACHE_DIR=cache``,
    ``OMP_NUM_THREADS=threads`` (None: as in this process; 0: unset, torch's default of one thread per core),
    unbuffered output, :func:`pythonpath` (``code``: another checkout's dufu first) and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV and not k.startswith("DUFU_BENCH_")}
    if cache is not None:
        env["DUFU_CACHE_DIR"] = str(cache)
    if threads == 0:
        env.pop("OMP_NUM_THREADS", None)
    elif threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath(*([code] if code else [])))
    env.update(extra or {})
    return env


def dufu_train(argv: list[str], nproc: int | None = None) -> list[str]:
    """``python -m dufu train [--nproc N] ARGV``: the user's command (with ``--nproc``, dufu's own launcher)."""
    return [sys.executable, "-m", "dufu", "train", *(["--nproc", str(nproc)] if nproc and nproc > 1 else []), *argv]


def torchrun_train(nproc: int, argv: list[str]) -> list[str]:
    """The torchrun command dufu's launcher would run for ``dufu train --nproc N ARGV`` (its workers directly)."""
    from dufu.parallel.launch import torchrun_command

    return torchrun_command(nproc, argv)


def hooks_override(*hooks: tuple[str, dict]) -> str:
    """``train.hooks=[...]``: hook objects for the job's Trainer, each ``(import path, keyword arguments)``; the
    path is importable by the workers (:func:`pythonpath`), e.g. ``("harness.memory.MemoryPhases", {...})``."""
    return "train.hooks=" + repr([{"_target_": target, **{k: (str(v) if isinstance(v, Path) else v)
                                                          for k, v in kwargs.items()}}
                                  for target, kwargs in hooks])


def read_records(run_dir: Path) -> list[dict]:
    """Every record of a run's ``metrics.jsonl`` (none if there is no such file)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict]:
    """The training-step records of a run's ``metrics.jsonl`` (those with a loss)."""
    return [r for r in read_records(run_dir) if "loss" in r]


def read_rank_files(folder: Path, nproc: int, name: str = "rank{rank}.json") -> list[dict] | None:
    """The JSON every rank of a job wrote to ``folder`` (``rank0.json`` ...), or None if one is missing."""
    files = [Path(folder) / name.format(rank=r) for r in range(nproc)]
    if not all(f.exists() for f in files):
        return None
    return [json.loads(f.read_text()) for f in files]


def write_rank_file(folder: Path, rank: int, record: dict, name: str = "rank{rank}.json") -> None:
    """Write a rank's record atomically (a reader never sees half a file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / name.format(rank=rank)
    tmp = folder / f".{final.name}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, final)
