"""Asynchronous checkpoints (``train.checkpointer.async_save=True``) on 4 processes (dp 2 x tp 2).

The step-5 checkpoint is written in the background while steps 6..9 update the weights and the
optimizer state in place; it must still hold exactly the step-5 state. Run B (same layout, synchronous
save, stopped at step 5) is the exact reference for step 5.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from checkpoint_runs import (
    assert_losses_match, assert_ok, checkpoint_names, consolidated, layout, train_records,
)

STEP5, STEP10 = "step_0000005", "step_0000010"


def async_run(jobs):
    proc = jobs.result("async_run")
    assert_ok(proc)
    return proc


def assert_states_equal(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), what
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k} differs"


@pytest.mark.checkpoint_jobs("async_run", "run_b")
def test_async_checkpoint_holds_exactly_the_state_of_its_step(jobs):
    proc = async_run(jobs)
    b = jobs.result("run_b")
    assert_ok(b)
    assert "saving checkpoint" in proc.output  # the asynchronous path was taken
    assert checkpoint_names(proc.output_dir) == [STEP5, STEP10]  # both committed, nothing partial
    for group in ("model", "optim"):
        assert_states_equal(
            consolidated(proc.output_dir / "checkpoints" / STEP5, group),
            consolidated(b.output_dir / "checkpoints" / STEP5, group),
            f"{group} state of the async step-5 checkpoint vs the synchronous one",
        )
    # Saving in the background does not change training: the same losses as the synchronous run.
    got, sync = train_records(proc.output_dir), train_records(b.output_dir)
    assert [got[s]["loss"] for s in range(1, 6)] == [sync[s]["loss"] for s in range(1, 6)]


@pytest.mark.checkpoint_jobs("async_run")
def test_async_run_matches_the_single_process_run(jobs, reference):
    proc = async_run(jobs)
    assert_losses_match(proc.output_dir, reference.losses, range(1, 11))
    final = consolidated(proc.output_dir / "checkpoints" / STEP10)
    single = consolidated(reference.output_dir / "checkpoints" / STEP10)
    assert set(final) == set(single)
    for k in single:
        torch.testing.assert_close(final[k], single[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.checkpoint_jobs("async_run")
def test_resume_from_an_async_checkpoint(jobs, reference, tmp_path, capsys):
    from dufu.cli import main

    proc = async_run(jobs)
    out = tmp_path / "run"
    shutil.copytree(proc.output_dir, out)
    shutil.rmtree(out / "checkpoints" / STEP10)  # continue from the one written in the background
    _, dist = layout("1")
    assert main(["train", str(out / "config.yaml"), "--resume", f"train.output_dir={out}", *dist]) == 0
    assert f"resumed from {out / 'checkpoints' / STEP5} (step 5)" in capsys.readouterr().out
    assert sorted(train_records(out)) == list(range(1, 11))
    assert_losses_match(out, reference.losses, range(6, 11))
