"""A resume continues the saved run: a changed schedule, global batch or data is refused unless named with
``--override-saved``; a config that leaves the global batch unset keeps the saved one in another layout; a named
checkpoint (``--resume-step``, ``--resume-from``) is resumed, a damaged newest one skipped by naming an earlier one;
a model of other shapes is one error naming them (dufu.engine.weights.resume_checks).

Every case starts from a copy of one single-process run of gpt_debug (6 steps, checkpoints at 2, 4 and 6, the
global batch left unset: 4 samples); the single-process cases call ``dufu train`` in this process, and one
2-process run resumes at dp 2.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import yaml

from checkpoint_runs import checkpoint_names
from launch import assert_ok, run, train_command
from parity import assert_losses_match, train_records
from dufu.cli import main as cli_main
from dufu.engine.weights.checkpoint import MANIFEST, Checkpointer
from dufu_testing import FAST, snapshot

# gpt_debug's micro batch 4, global batch unset: 4 samples per step in one process.
RUN = (*FAST, "train.train_iter=6", "train.checkpointer.period=2", "train.checkpointer.max_to_keep=0")
STEP = "step_{:07d}".format


@pytest.fixture(scope="module")
def first(tmp_path_factory, dufu_cache_dir):
    """The saved run: one process, 6 steps, checkpoints at steps 2, 4 and 6 (all kept)."""
    out = tmp_path_factory.mktemp("resume_checks") / "first"
    assert cli_main(["train", "gpt_debug", *RUN, f"train.output_dir={out}"]) == 0
    assert checkpoint_names(out) == [STEP(2), STEP(4), STEP(6)]
    return out


def copy_of(first, tmp_path, name: str = "run"):
    out = tmp_path / name
    shutil.copytree(first, out)
    return out


def error(capsys) -> str:
    """dufu's one error paragraph on stderr, joined into one line; no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: " in err, err
    return " ".join(err[err.index("error: "):].split())


def test_a_changed_schedule_batch_or_data_is_refused_naming_each_and_runs_with_the_override(first, tmp_path,
                                                                                             capsys):
    out = copy_of(first, tmp_path)
    before = snapshot(out)
    resume = ["train", str(out / "config.yaml"), "--resume", f"train.output_dir={out}"]
    assert cli_main([*resume, "train.train_iter=8", "train.seed=7", "train.global_batch_size=8"]) == 2
    said = error(capsys)
    for fragment in ("train.train_iter 6 -> 8 (learning-rate schedule)", "train.seed 1234 -> 7 (data)",
                     "train.global_batch_size 4 -> 8 (global batch", "--override-saved train.train_iter",
                     "--override-saved train.seed", "--override-saved train.global_batch_size"):
        assert fragment in said, said
    assert cli_main([*resume, "train.train_iter=8", "--override-saved", "train.trian_iter"]) == 2
    assert "--override-saved train.trian_iter: not a setting a resume compares" in error(capsys)
    assert snapshot(out) == before  # nothing was written

    assert cli_main([*resume, "train.train_iter=8", "--override-saved", "train.train_iter"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "--override-saved: train.train_iter 6 -> 8 (learning-rate schedule), from step 6 on" in said
    assert f"resumed from {out / 'checkpoints' / STEP(6)} (step 6)" in said
    got, saved = train_records(out), train_records(first)
    assert sorted(got) == list(range(1, 9)) and all(got[s] == saved[s] for s in range(1, 7))
    # step 7 takes the 8-step schedule's rate at step 6 (warm-up 2, cosine to 0.1 x lr 1e-3), not the 6-step
    # schedule's floor of 1e-4
    factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (6 - 2) / (8 - 2)))
    assert got[7]["lr"] == pytest.approx(1e-3 * factor, rel=1e-9) and saved[6]["lr"] != got[7]["lr"]


def test_resume_from_another_runs_checkpoint_and_a_missing_step_lists_those_present(first, tmp_path, capsys):
    out = copy_of(first, tmp_path)
    assert cli_main(["train", str(out / "config.yaml"), "--resume-step", "3", f"train.output_dir={out}"]) == 2
    said = error(capsys)
    assert f"--resume-step 3: checkpoint {out / 'checkpoints' / STEP(3)} does not exist" in said, said
    assert "steps 2, 4, 6: name one of them" in said, said

    before = snapshot(first)
    branch = tmp_path / "branch"
    source = first / "checkpoints" / STEP(2)
    assert cli_main(["train", str(first / "config.yaml"), "--resume-from", str(source),
                     f"train.output_dir={branch}"]) == 0
    assert f"resumed from {source} (step 2)" in " ".join(capsys.readouterr().out.split())
    assert sorted(train_records(branch)) == [3, 4, 5, 6]
    assert_losses_match(branch, {s: r["loss"] for s, r in train_records(first).items()}, range(3, 7), rel=0.0)
    assert checkpoint_names(branch) == [STEP(4), STEP(6)]
    assert snapshot(first) == before  # the run it branched from is untouched


@pytest.mark.multiprocess
def test_two_processes_keep_the_saved_global_batch_and_skip_a_corrupt_newest_checkpoint(first, tmp_path, capsys):
    out = copy_of(first, tmp_path)
    shard = out / "checkpoints" / STEP(6) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = snapshot(out)
    args = [*RUN, "train.dist.data_parallel_size=-1", f"train.output_dir={out}"]
    # `--nproc 2 --resume` at gpt_debug's micro batch 4: 4 x dp 2 cannot make the saved global batch of 4
    assert cli_main(["train", "gpt_debug", "--nproc", "2", "--resume", *args]) == 2
    said = error(capsys)
    assert "keeps the checkpoint's global batch of 4, but train_micro_batch_size 4 x data_parallel_size 2 = 8 " \
           "does not divide it" in said and "set train.train_micro_batch_size=2" in said, said
    # at micro batch 1 it can; the newest checkpoint is damaged, and the error says how to take another
    assert cli_main(["train", "gpt_debug", "--nproc", "2", "--resume", *args, "train.train_micro_batch_size=1"]) == 2
    said = error(capsys)
    assert f"checkpoint file {shard} is corrupt" in said and "--resume-step N" in said and "steps 2, 4." in said, said
    assert snapshot(out) == before  # nothing was written, no worker started

    proc = run(train_command("gpt_debug", out, 2, *RUN, "train.dist.data_parallel_size=-1",
                             "train.train_micro_batch_size=1", flags=("--resume-step", "4")), output_dir=out)
    assert_ok(proc)
    said = " ".join(proc.stdout.split())
    assert f"resumed from {out / 'checkpoints' / STEP(4)} (step 4)" in said
    assert "global batch 4 kept from checkpoint step_0000004 (train.global_batch_size is unset)" in said
    assert "global 4 = micro 1 x dp 2 x accumulation 2; 128 tokens/step" in said
    # the damaged step-6 checkpoint was set aside, and this run saved its own
    assert (out / "checkpoints" / "replaced_at_step_0000004" / STEP(6) / MANIFEST).is_file()
    Checkpointer(out / "checkpoints").verify(out / "checkpoints" / STEP(6))
    assert json.loads((out / "checkpoints" / STEP(6) / MANIFEST).read_text())["global_batch_size"] == 4
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["global_batch_size"] == 4
    got = train_records(out)
    assert sorted(got) == list(range(1, 7)) and [got[s]["consumed_samples"] for s in (5, 6)] == [20, 24]
    assert_losses_match(out, {s: r["loss"] for s, r in train_records(first).items()}, range(5, 7))


def test_a_model_shape_mismatch_names_the_parameters_and_both_shapes(first, tmp_path, capsys):
    out = copy_of(first, tmp_path)
    before = snapshot(out)
    assert cli_main(["train", str(out / "config.yaml"), "--resume", f"train.output_dir={out}",
                     "model.hidden_size=32"]) == 2
    said = error(capsys)
    assert f"checkpoint {out / 'checkpoints' / STEP(6)} holds a different model" in said, said
    assert "wte.weight saved (384, 64), this model (384, 32)" in said, said
    assert "model.hidden_size 64 -> 32" in said, said
    assert snapshot(out) == before
