"""Preemption: SIGTERM or SIGUSR1 mid-run makes every rank finish its step, save a checkpoint and exit with code
75 (dufu.engine.resilience.preemption); ``--resume`` then continues with exactly the losses of an uninterrupted run.

The signal comes from ``DUFU_FAULT=term:0:4`` / ``usr1:0:4``: as step 4 starts, rank 0 signals its job's main
process (the launcher under ``--nproc``, itself in one process), as a scheduler preempting the job would; the
launcher's torchrun agent passes the signal on to every worker.
"""

from __future__ import annotations

import json

import pytest

import launch
from dufu.engine.resilience.preemption import PREEMPTED_EXIT_CODE
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
    signal = "SIGTERM" if fault.startswith("term") else "SIGUSR1"
    assert f"preempted by {signal}" in first.stdout + first.stderr
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_0000004"]
    assert json.loads((out / "preempted.json").read_text()) == {"step": 4, "signal": signal}
    second = launch.run(launch.train_command("gpt_debug", out, nproc, *RUN, *layout, resume=True), output_dir=out)
    launch.assert_ok(second)
    assert not (out / "preempted.json").exists()
    assert_matches_reference(collect(out), uninterrupted, f"preempted by {signal} at step 4, resumed", steps=8)
