"""Faults during training, injected with ``DUFU_FAULT`` into 2-process jobs: a rank that dies, a rank
that hangs, an elastic restart, and a non-finite gradient on one rank."""

from __future__ import annotations

import math
import os
import re

import pytest

from checkpoint_runs import COMMON, checkpoint_names, error_text
from launch import assert_ok
from parity import assert_losses_match, records, train_records

pytestmark = pytest.mark.multiprocess

STEP5, STEP10 = "step_0000005", "step_0000010"


def seconds_after_last_log(proc) -> float:
    """Time from rank 0's last metrics record (the end of step 2; the faults fire as step 3 starts)
    to the end of the job."""
    return proc.ended - (proc.output_dir / "metrics.jsonl").stat().st_mtime


@pytest.mark.checkpoint_jobs("exit_fault")
def test_a_rank_that_dies_stops_the_whole_job(jobs):
    proc = jobs.result("exit_fault")
    assert proc.returncode != 0, proc.describe()
    assert sorted(train_records(proc.output_dir)) == [1, 2]
    assert seconds_after_last_log(proc) < 60, proc.describe()
    assert proc.seconds < 300, proc.describe()
    assert not [n for n in checkpoint_names(proc.output_dir) if n.startswith("step_")]


@pytest.mark.checkpoint_jobs("hang_fault")
def test_a_rank_that_hangs_stops_the_job_after_the_timeout_naming_it(jobs):
    proc = jobs.result("hang_fault")  # train.dist.timeout_minutes=0.25
    assert proc.returncode != 0, proc.describe()
    assert sorted(train_records(proc.output_dir)) == [1, 2]
    # 15 s collective timeout + up to 15 s to find who does not respond + slack
    assert seconds_after_last_log(proc) < 75, proc.describe()
    assert proc.seconds < 120, proc.describe()
    message = error_text(proc)
    assert "step 3" in message, proc.describe()
    assert re.search(r"\b[Rr]ank(\(s\))? 1\b[^.]*(did not respond|hang|died)", message), message


@pytest.mark.checkpoint_jobs("restart")
def test_a_restarted_job_resumes_from_the_last_checkpoint_and_finishes(jobs, reference):
    proc = jobs.result("restart")  # --max-restarts 1, rank 2 of 4 is killed (SIGKILL) at step 7 of attempt 1
    assert_ok(proc)
    out = proc.output_dir
    # what died, where and how, in dufu's words; the restart on the record
    assert "worker local rank 2 (pid " in proc.stderr and "died: killed by SIGKILL" in proc.stderr, proc.describe()
    restarts = [r for r in records(out) if "restart" in r]
    assert restarts == [{"step": 5, "restart": 1, "resumed_from": STEP5}]
    # The first attempt started from scratch; only a restart can have resumed.
    assert f"resumed from {out / 'checkpoints' / STEP5} (step 5)" in proc.stdout
    assert sorted(train_records(out)) == list(range(1, 11))  # steps 6 and 7 of attempt 1 not kept twice
    assert_losses_match(out, reference.output_dir, range(1, 11))
    assert checkpoint_names(out) == [STEP5, STEP10]


# ----------------------------------------------------------------------------- non-finite gradients

@pytest.fixture(scope="session")
def skip_reference(tmp_path_factory, dufu_cache_dir) -> dict[int, dict]:
    """One process, the same 5 steps with step 3's NaN gradient skipped: the records every layout must log."""
    from dufu_testing import train

    old = os.environ.get("DUFU_FAULT")
    os.environ["DUFU_FAULT"] = "nan:0:3"
    try:
        run = train(tmp_path_factory.mktemp("nan_skip_reference") / "run",
                    [*COMMON, "train.train_iter=5", "train.nan_policy=skip"])
    finally:
        if old is None:
            os.environ.pop("DUFU_FAULT")
        else:
            os.environ["DUFU_FAULT"] = old
    return train_records(run.output_dir)


def parameter_names(reference) -> list[str]:
    return [name for name, _ in reference.trainer.model.named_parameters()]


def check_nan_stop(proc, reference) -> None:
    assert proc.returncode != 0, proc.describe()
    assert sorted(train_records(proc.output_dir)) == [1, 2]
    message = error_text(proc)
    assert "step 3" in message, proc.describe()
    named = [n for n in parameter_names(reference) if re.search(rf"\b{re.escape(n)}\b", message)]
    assert named and "inf/NaN" in message, message
    assert seconds_after_last_log(proc) < 60, proc.describe()  # no rank waits for a collective timeout


def check_nan_skip(proc, skip_reference) -> None:
    assert_ok(proc)
    got = train_records(proc.output_dir)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert [got[s].get("skipped_steps", 0) for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert not math.isfinite(got[3]["grad_norm"])
    assert all(math.isfinite(got[s]["loss"]) for s in (1, 2, 4, 5))
    # Step 3's update was dropped on every rank: step 4 and 5 see the weights of step 2, as in one process.
    assert_losses_match(proc.output_dir, {s: r["loss"] for s, r in skip_reference.items()}, (1, 2, 4, 5))
    assert [r["step"] for r in records(proc.output_dir)] == [1, 2, 3, 4, 5]


# tp 2: the gradient norm is reduced over the tensor-parallel ranks anyway; dp 2: replicated gradients,
# whose norm every rank computes alone, so the ranks must agree on the verdict explicitly.
NAN_LAYOUTS = ("tp2", "dp2")


@pytest.mark.parametrize(
    "lay", [pytest.param(x, marks=pytest.mark.checkpoint_jobs(f"nan_stop_{x}")) for x in NAN_LAYOUTS]
)
def test_nan_stop_names_the_step_and_a_parameter(lay, jobs, reference):
    check_nan_stop(jobs.result(f"nan_stop_{lay}"), reference)


@pytest.mark.parametrize(
    "lay", [pytest.param(x, marks=pytest.mark.checkpoint_jobs(f"nan_skip_{x}")) for x in NAN_LAYOUTS]
)
def test_nan_skip_drops_the_update_on_every_rank(lay, jobs, skip_reference):
    check_nan_skip(jobs.result(f"nan_skip_{lay}"), skip_reference)
