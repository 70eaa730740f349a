"""Preemption and Ctrl-C (dufu.engine.resilience.preemption).

SIGTERM or SIGUSR1 mid-run makes every rank finish its step, save a checkpoint and exit with code 75;
``--resume`` then continues with exactly the losses of an uninterrupted run. The signal comes from
``DUFU_FAULT=term:0:4`` / ``usr1:0:4``: as step 4 starts, rank 0 signals its job's main process (the launcher
under ``--nproc``, itself in one process), as a scheduler preempting the job would; the launcher's torchrun agent
passes the signal on to every worker.

Ctrl-C (SIGINT) takes the same path, sent here as a terminal sends it, to the job's whole process group, once a
step is logged (``slow:*:1`` makes every step take 0.1 s longer, so the run is still going): the run saves the
step it reached, exits with 130 and prints the command that continues it, which then gives the uninterrupted
losses when run as printed. A second Ctrl-C during the save (``hang_in_save`` holds the save open) stops the job at
once, with code 130, and leaves the previous checkpoint complete.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest

import launch
from dufu.engine.resilience.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from dufu.engine.weights.checkpoint import Checkpointer
from parity import PARITY_ARGS, assert_matches_reference, collect, parity_run

pytestmark = pytest.mark.multiprocess

RUN = (*PARITY_ARGS, "train.train_iter=8", "train.checkpointer.period=0", "train.log_period=1")
DP2 = "train.dist.data_parallel_size=2"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    return parity_run(out, 1, *RUN[len(PARITY_ARGS):])


@pytest.mark.parametrize("fault,nproc", [("term:0:4", 1), ("usr1:0:4", 2)], ids=["sigterm-1-process", "sigusr1-dp2"])
def test_a_preempted_run_saves_exits_75_and_resumes_exactly(fault, nproc, uninterrupted, tmp_path):
    out = tmp_path / "run"
    layout = (DP2,) if nproc > 1 else ()
    first = launch.run(launch.train_command("gpt_debug", out, nproc, *RUN, *layout), output_dir=out, fault=fault)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.describe()
    signal_name = "SIGTERM" if fault.startswith("term") else "SIGUSR1"
    assert f"preempted by {signal_name}" in first.stdout + first.stderr
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_0000004"]
    assert json.loads((out / "preempted.json").read_text()) == {"step": 4, "signal": signal_name}
    second = launch.run(launch.train_command("gpt_debug", out, nproc, *RUN, *layout, resume=True), output_dir=out)
    launch.assert_ok(second)
    assert not (out / "preempted.json").exists()
    assert_matches_reference(collect(out), uninterrupted, f"preempted by {signal_name} at step 4, resumed", steps=8)


# ------------------------------------------------------------------------------------------ Ctrl-C


def _wait_for(ready, pid: int, run: launch.Started, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            raise AssertionError(f"{what} did not happen within {timeout} s:\n{run.result().describe()}")
        time.sleep(0.02)


def _logged_steps(out: Path) -> int:
    """The last training step in metrics.jsonl (0 before the first; a line still being written is skipped)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            steps.append(record["step"])
    return max(steps)


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def _resume_commands(proc: launch.Proc) -> set[str]:
    """The commands after "continue with: " in what the run printed (the end summary, the launcher)."""
    return set(re.findall(r"continue with: (dufu train .*?--resume)", proc.output))


def _ctrl_c(nproc: int, out: Path, *overrides: str, fault: str) -> tuple[launch.Proc, int]:
    """Start a run, send SIGINT to its process group once a step is logged; returns what the run printed and
    the pid of its leader."""
    layout = (DP2,) if nproc > 1 else ()
    run = launch.start(launch.train_command("gpt_debug", out, nproc, *RUN, *layout, *overrides), output_dir=out,
                       fault=fault, timeout=300)
    pid = run.pid()
    _wait_for(lambda: _logged_steps(out) >= 1, pid, run, "a logged step")
    os.killpg(pid, signal.SIGINT)
    return run.result(), pid


@pytest.mark.parametrize("nproc", [1, 2], ids=["1-process", "dp2"])
def test_ctrl_c_saves_the_step_reached_and_the_printed_command_resumes_exactly(nproc, uninterrupted, tmp_path):
    out = tmp_path / "run"
    first, _ = _ctrl_c(nproc, out, fault="slow:*:1")
    assert first.returncode == INTERRUPTED_EXIT_CODE, first.describe()
    marker = json.loads((out / "preempted.json").read_text())
    step = marker["step"]
    assert marker["signal"] == "SIGINT" and 1 <= step < 8, marker
    assert _checkpoints(out) == [f"step_{step:07d}"]
    assert "Ctrl-C again to stop at once" in first.stderr
    assert "Traceback" not in first.output and "collective operation" not in first.output, first.describe()
    command = f"dufu train {out / 'config.yaml'}{' --nproc 2' if nproc > 1 else ''} --resume"
    assert _resume_commands(first) == {command}, first.describe()

    second = launch.run([sys.executable, "-m", *shlex.split(command)], output_dir=out)  # `dufu` is `python -m dufu`
    launch.assert_ok(second)
    assert f"resumed from {out / 'checkpoints' / f'step_{step:07d}'}" in second.output
    assert_matches_reference(collect(out), uninterrupted, f"Ctrl-C at step {step} ({nproc} processes), resumed",
                             steps=8)


def test_a_second_ctrl_c_abandons_the_save_at_once_and_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    layout = (DP2,)
    run = launch.start(launch.train_command("gpt_debug", out, 2, *RUN, *layout, "train.checkpointer.period=2"),
                       output_dir=out, fault="slow:*:1,hang_in_save:0:3", timeout=300)
    pid = run.pid()
    previous = out / "checkpoints" / "step_0000002"
    _wait_for(previous.exists, pid, run, "the checkpoint of step 2")
    os.killpg(pid, signal.SIGINT)
    # the save that the first Ctrl-C asked for (step 3 or later) has begun: rank 0 hangs in it
    _wait_for(lambda: any(int(p.name[6:13]) >= 3 for p in (out / "checkpoints").glob(".step_*.partial")), pid, run,
              "the save after Ctrl-C")
    sent = time.time()
    os.killpg(pid, signal.SIGINT)
    proc = run.result()
    assert proc.returncode == INTERRUPTED_EXIT_CODE, proc.describe()
    assert proc.ended - sent < 30, f"the job took {proc.ended - sent:.0f} s to stop after the second Ctrl-C"
    text = " ".join(proc.stderr.split())
    assert "stopped at once; the checkpoint being saved (if any) was abandoned" in text, proc.describe()
    assert (f"The last complete checkpoint, {previous}, is intact; continue from it with: "
            f"dufu train {out / 'config.yaml'} --nproc 2 --resume") in text, proc.describe()
    assert "Traceback" not in proc.output, proc.describe()
    assert _checkpoints(out) == ["step_0000002"] and not (out / "preempted.json").exists()
    checkpointer = Checkpointer(out / "checkpoints")
    assert checkpointer.latest() == previous
    assert checkpointer.verify(previous)["step"] == 2
    assert checkpointer.consolidated_model_state(previous)  # loads
