"""The restartable job script of a cluster, ``until dufu train CONFIG --resume ...; do :; done``, finishes the run
with the losses of an uninterrupted one whatever moment its job is killed at: during start-up (before any
checkpoint exists: ``--resume`` then starts at step 0 with a notice), and twice mid-run with SIGKILL, which leaves
no time to save (the run resumes from the newest complete checkpoint and repeats the steps after it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch
from parity import PARITY_ARGS, assert_matches_reference, collect, parity_run

pytestmark = pytest.mark.multiprocess

RUN = ("train.train_iter=9", "train.checkpointer.period=3", "train.log_period=1")


def _dufu_pids(output_dir: Path) -> list[int]:
    """The dufu processes of this run (their command line names its output_dir; the script's does not)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"train.output_dir={output_dir}".encode() in argv:
                pids.append(int(entry.name))
    return pids


def _kill_when(output_dir: Path, ready, script: subprocess.Popen, timeout: float = 300) -> None:
    """SIGKILL the run's dufu process as soon as ``ready()`` holds (the script then starts it again)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert script.poll() is None, "the job script ended before the planned kill"
        pids = _dufu_pids(output_dir)
        if pids and ready():
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            while _dufu_pids(output_dir):  # gone before the next attempt is looked for
                time.sleep(0.05)
            return
        time.sleep(0.05)
    raise AssertionError(f"no moment to kill the run came within {timeout} s")


def test_a_resume_loop_finishes_the_run_whatever_moment_it_is_killed_at(tmp_path):
    reference = parity_run(tmp_path / "uninterrupted", 1, *RUN)
    out = tmp_path / "run"
    command = " ".join(launch.train_command("gpt_debug", out, 1, *PARITY_ARGS, *RUN, resume=True))
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nattempts=0\nuntil {command}; do attempts=$((attempts+1)); done\n"
                      f"echo \"finished after $attempts restarts\"\n")
    job = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=launch._child_env(None, None), start_new_session=True)
    try:
        checkpoints = lambda: {p.name for p in (out / "checkpoints").glob("step_*")}  # noqa: E731
        started = time.monotonic()
        _kill_when(out, lambda: time.monotonic() - started > 0.5, job)  # in start-up: Python is still importing
        assert not checkpoints()
        _kill_when(out, lambda: "step_0000003" in checkpoints(), job)  # after the first checkpoint
        _kill_when(out, lambda: "step_0000006" in checkpoints(), job)  # after the second
        stdout, stderr = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stderr[-3000:]
    assert "finished after 3 restarts" in stdout
    assert "holds no complete checkpoint yet, so this run starts at step 0" in " ".join((stdout + stderr).split())
    assert_matches_reference(collect(out), reference, "a job script killed three times", steps=9)
