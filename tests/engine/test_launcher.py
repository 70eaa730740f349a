"""``dufu train --nproc N`` runs torchrun's agent inside the launcher process (dufu.cli.torchrun.run_torchrun), so the
exit code and the failure report must be those of the ``torchrun`` command: 0 for a finished job, 1 with the
failed ranks' summary when a worker fails."""

from __future__ import annotations

import sys

import pytest

import launch
from dufu.cli.torchrun import run_torchrun
from dufu.errors import DufuError

ARGS = ("train.train_iter=3", "train.global_batch_size=4", "train.train_micro_batch_size=2",
        "train.evaluation.enabled=False", "train.checkpointer.period=0", "train.tensorboard=False",
        "train.peak_tflops=1.0", "train.dist.data_parallel_size=2")


def test_only_a_torchrun_command_line_is_run():
    with pytest.raises(DufuError, match="not a torchrun command line"):
        run_torchrun([sys.executable, "-m", "dufu", "train"])


@pytest.mark.multiprocess
def test_a_failed_worker_fails_the_launch_with_torchruns_report(tmp_path):
    out = tmp_path / "run"
    proc = launch.run(launch.train_command("gpt_debug", out, 2, *ARGS), output_dir=out, fault="exit:1:2",
                      timeout=300)
    assert proc.returncode == 1, proc.describe()
    assert "ChildFailedError" in proc.stderr and "exitcode  : 1" in proc.stderr, proc.describe()
    assert "rank      : 1" in proc.stderr, proc.describe()  # torchrun's summary names the failed rank
    # a new interpreter, as a user starts it (its worker server a new interpreter too), not a fork of the tests'
    # warm process server (tests/warm.py)
    ok = launch.run(launch.train_command("gpt_debug", tmp_path / "ok", 2, *ARGS), output_dir=tmp_path / "ok",
                    timeout=300, new_interpreter=True)
    launch.assert_ok(ok)
    assert (tmp_path / "ok" / "metrics.jsonl").read_text().count('"loss"') == 3
