"""Logged throughput in multi-process layouts covers every rank's steps, not rank 0's alone.

Under pipeline parallelism rank 0 is the first stage; a step's work ends later on the last stage. pp2 and
dp2 x pp2 run through a worker that records each rank's own time in every step (``record_step_times.py``), with
the last rank made to finish each step later than the others (it sleeps after the step's last collective). For
every logged window, the logged time (``step_time_s`` x the window's steps) must be at least the time the
slowest rank spent in that window's steps, and tokens/s and MFU must follow from it with the global token count
and every device's peak. Only relations between measured times are checked, never a time against a constant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import launch
from dufu.config import instantiate
from dufu.engine.reporting.report import model_flops_per_token
from dufu_testing import load_config, read_records

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("record_step_times.py")
ARGS = ("train.train_iter=5", "train.global_batch_size=8", "train.train_micro_batch_size=2",
        "train.evaluation.enabled=False", "train.checkpointer.period=0", "train.tensorboard=False",
        "train.generation.enabled=False", "train.peak_tflops=1.0")
LAYOUTS = {
    # name: (processes, overrides, log period)
    "pp2": (2, ("train.dist.pipeline_parallel_size=2",), 1),
    "dp2xpp2": (4, ("train.dist.pipeline_parallel_size=2", "train.dist.data_parallel_size=2"), 2),
}
SEQ, GLOBAL_BATCH, PEAK = 32, 8, 1e12  # gpt_debug's sequence, the batch and peak of ARGS


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logged_step_time_covers_the_slowest_ranks_steps(layout, tmp_path):
    nproc, dist_args, period = LAYOUTS[layout]
    out, times = tmp_path / "run", tmp_path / "step_times"
    times.mkdir()
    cmd = launch.torchrun_command(WORKER, nproc, "train", "gpt_debug", f"train.output_dir={out}", *ARGS, *dist_args,
                                  f"train.log_period={period}")
    launch.assert_ok(launch.run(cmd, output_dir=out, scratch=[times], timeout=300,
                                env={"DUFU_TEST_STEP_TIMES": str(times), "DUFU_TEST_SLOW_RANK": f"{nproc - 1}:0.2"}))

    own = {}  # rank -> {step: seconds in train_step}
    for f in times.glob("rank*.jsonl"):
        own[int(f.stem[4:])] = {r["step"]: r["seconds"] for r in map(json.loads, f.read_text().splitlines())}
    assert sorted(own) == list(range(nproc)) and all(sorted(s) == [1, 2, 3, 4, 5] for s in own.values()), own

    records = [r for r in read_records(out) if "loss" in r]
    expected_steps = [1, 2, 3, 4, 5] if period == 1 else [2, 4, 5]  # the last step is always logged
    assert [r["step"] for r in records] == expected_steps

    with torch.device("meta"):
        flops_per_token = model_flops_per_token(instantiate(load_config("gpt_debug", ARGS).model), SEQ)
    previous = 0
    for r in records:
        steps = range(previous + 1, r["step"] + 1)
        logged = r["step_time_s"] * len(steps)
        busy = {rank: sum(s[n] for n in steps) for rank, s in own.items()}
        slowest = max(busy, key=busy.get)
        assert logged >= busy[slowest] * (1 - 1e-9), (
            f"{layout}, steps {steps.start}-{steps.stop - 1}: logged {logged:.4f} s, but rank {slowest} spent "
            f"{busy[slowest]:.4f} s in them (every rank: {busy})")
        assert r["tokens_per_s"] == pytest.approx(GLOBAL_BATCH * SEQ / r["step_time_s"], rel=1e-9)
        assert r["mfu"] == pytest.approx(flops_per_token * r["tokens_per_s"] / (PEAK * nproc), rel=1e-9)
        previous = r["step"]
