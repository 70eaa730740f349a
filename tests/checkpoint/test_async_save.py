"""Asynchronous checkpoints (``train.checkpointer.async_save=True``).

A checkpoint is staged and then written in the background while the next steps update the weights and
the optimizer state in place; it must still hold exactly the state of its own step. The exact
reference is a synchronous save of the same training in the same layout: run A (one process) and run B
(dp 2 x tp 2, 4 processes, stopped at step 5).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from checkpoint_runs import COMMON, checkpoint_names, consolidated, layout
from launch import assert_ok
from parity import assert_checkpoint_matches, assert_losses_match, train_records

STEP5, STEP10 = "step_0000005", "step_0000010"


# The single-process background save warns (from its own thread) that it runs without a process group.
pytestmark = [pytest.mark.multiprocess,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


def assert_states_equal(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), what
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k} differs"


@pytest.fixture(scope="session")
def async_single(tmp_path_factory, dufu_cache_dir):
    """Run A again (one process, in this process), saving asynchronously."""
    from dufu_testing import train

    return train(tmp_path_factory.mktemp("async_single") / "run", [*COMMON, "train.checkpointer.async_save=True"])


def test_async_checkpoints_hold_exactly_the_state_of_their_step(async_single, reference):
    assert async_single.trainer.checkpointer.async_save
    assert checkpoint_names(async_single.output_dir) == [STEP5, STEP10]  # both committed, nothing partial
    for step in (STEP5, STEP10):
        for group in ("model", "optim"):
            assert_states_equal(
                consolidated(async_single.output_dir / "checkpoints" / step, group),
                consolidated(reference.output_dir / "checkpoints" / step, group),
                f"{group} state of the async {step} vs the synchronous one",
            )
    assert async_single.losses == reference.losses  # saving in the background does not change training


def test_resume_from_an_async_checkpoint(async_single, reference, tmp_path, capsys):
    from dufu.cli import main

    out = tmp_path / "run"
    shutil.copytree(async_single.output_dir, out)
    shutil.rmtree(out / "checkpoints" / STEP10)  # continue from the one written in the background
    _, dist = layout("1")
    assert main(["train", str(out / "config.yaml"), "--resume", f"train.output_dir={out}", *dist]) == 0
    assert f"resumed from {out / 'checkpoints' / STEP5} (step 5)" in capsys.readouterr().out
    assert sorted(train_records(out)) == list(range(1, 11))
    assert_losses_match(out, reference.output_dir, range(6, 11))


def async_run(jobs):
    proc = jobs.result("async_run")
    assert_ok(proc)
    return proc


@pytest.mark.checkpoint_jobs("async_run", "run_b")
def test_multi_process_async_checkpoint_holds_exactly_the_state_of_its_step(jobs):
    proc = async_run(jobs)
    b = jobs.result("run_b")
    assert_ok(b)
    assert "saving checkpoint" in proc.output  # the asynchronous path was taken
    names = checkpoint_names(proc.output_dir)
    assert names == [f"step_{s:07d}" for s in range(1, 11)]  # all committed, nothing partial
    for group in ("model", "optim"):
        assert_states_equal(
            consolidated(proc.output_dir / "checkpoints" / STEP5, group),
            consolidated(b.output_dir / "checkpoints" / STEP5, group),
            f"{group} state of the async step-5 checkpoint vs the synchronous one",
        )
    got, sync = train_records(proc.output_dir), train_records(b.output_dir)
    assert [got[s]["loss"] for s in range(1, 6)] == [sync[s]["loss"] for s in range(1, 6)]


@pytest.mark.checkpoint_jobs("async_run")
def test_multi_process_async_run_matches_the_single_process_run_and_resumes(jobs, reference, tmp_path, capsys):
    from dufu.cli import main

    proc = async_run(jobs)
    assert_losses_match(proc.output_dir, reference.output_dir, range(1, 11))
    final = consolidated(proc.output_dir / "checkpoints" / STEP10)
    assert_checkpoint_matches(final, reference.output_dir, 10, "async dp 2 x tp 2, step 10")
    # continue from the step-5 checkpoint, written while steps 6.. ran, in one process
    out = tmp_path / "run"
    shutil.copytree(proc.output_dir, out)
    for s in range(6, 11):
        shutil.rmtree(out / "checkpoints" / f"step_{s:07d}")
    _, dist = layout("1")
    assert main(["train", str(out / "config.yaml"), "--resume", f"train.output_dir={out}", *dist,
                 "train.checkpointer.async_save=False"]) == 0
    assert f"resumed from {out / 'checkpoints' / STEP5} (step 5)" in capsys.readouterr().out
    assert_losses_match(out, reference.output_dir, range(6, 11))
