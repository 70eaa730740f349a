"""Crash safety: a kill -9 in the middle of a save, damaged files, and checkpoints crafted to run code.

The kill comes from the fault injector: ``DUFU_FAULT=kill_in_save:0:10`` SIGKILLs the job (rank 0 and
its torchrun agent) after the step-10 shards are on disk, before the checkpoint is committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint_runs import checkpoint_names, consolidated, layout
from launch import assert_ok, run, train_command
from parity import assert_checkpoint_matches, assert_losses_match, train_records
from dufu.engine.weights.checkpoint import MANIFEST, Checkpointer
from dufu.errors import CheckpointError
from dufu_testing import snapshot

pytestmark = pytest.mark.multiprocess

STEP5, STEP10 = "step_0000005", "step_0000010"


# ------------------------------------------------------------------------- kill -9 during a save


@pytest.mark.parametrize("lay", [
    pytest.param("1", marks=pytest.mark.checkpoint_jobs("kill_1")),
    pytest.param("dp2", marks=pytest.mark.checkpoint_jobs("kill_dp2")),
])
def test_kill_during_a_save_keeps_the_last_checkpoint_and_resume_finishes_the_run(lay, jobs, reference):
    crashed, after_crash, resumed = jobs.result(f"kill_{lay}")
    assert crashed.returncode != 0, crashed.describe()
    assert sorted(train_records(after_crash)) == list(range(1, 11))  # it died while saving step 10

    # As the crash left it: step 5 complete, step 10 only a partial directory (shards, no manifest).
    root = after_crash / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [f".{STEP10}.partial", STEP5]
    partial = root / f".{STEP10}.partial"
    assert any(partial.glob("*.distcp")) and not (partial / MANIFEST).exists()
    checkpointer = Checkpointer(root)
    assert checkpointer.latest() == root / STEP5
    assert checkpointer.verify(root / STEP5)["world_size"] == layout(lay)[0]
    assert_checkpoint_matches(consolidated(root / STEP5), reference.output_dir, 5, f"kill_{lay}, step 5")

    # --resume takes step 5, says so, and the finished run has the uninterrupted losses.
    assert_ok(resumed)
    out = resumed.output_dir
    assert f"resumed from {out / 'checkpoints' / STEP5} (step 5)" in resumed.stdout
    assert sorted(train_records(out)) == list(range(1, 11))
    assert_losses_match(out, reference.output_dir, range(1, 11))
    assert checkpoint_names(out) == [STEP5, STEP10]


# ------------------------------------------------------------------------- damaged files


def copy_of_run_b(jobs, tmp_path):
    b = jobs.result("run_b")
    assert_ok(b)
    out = tmp_path / "run"
    shutil.copytree(b.output_dir, out)
    return out, out / "checkpoints" / STEP5


def flip_one_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.checkpoint_jobs("run_b")
def test_a_truncated_shard_stops_resume_naming_the_file(jobs, tmp_path):
    out, ckpt = copy_of_run_b(jobs, tmp_path)
    shard = ckpt / "__2_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = snapshot(out)
    n, dist = layout("1")
    proc = run(train_command(out / "config.yaml", out, n, *dist, resume=True), output_dir=out, timeout=300)
    assert proc.returncode == 2, proc.describe()
    message = one_line(proc.stderr)
    assert f"checkpoint file {shard} is truncated" in message
    assert "Traceback" not in proc.stderr
    assert snapshot(out) == before  # nothing was written


@pytest.mark.checkpoint_jobs("run_b")
def test_a_flipped_byte_is_a_checkpoint_error_naming_the_file(jobs, tmp_path):
    out, ckpt = copy_of_run_b(jobs, tmp_path)
    shard = ckpt / "__1_0.distcp"
    flip_one_byte(shard)
    with pytest.raises(CheckpointError, match="checksum") as info:
        Checkpointer(ckpt.parent).consolidated_model_state(ckpt)
    assert str(shard) in str(info.value)
    proc = run([sys.executable, "-m", "dufu", "convert", str(out), "--to-torch", str(tmp_path / "x.pt")])
    assert proc.returncode == 2, proc.describe()
    assert f"checkpoint file {shard} is corrupt" in one_line(proc.stderr)
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.checkpoint_jobs("corrupt_resume_dp2")
def test_a_flipped_byte_stops_a_multi_process_resume_cleanly(jobs):
    shard, proc = jobs.result("corrupt_resume_dp2")
    assert proc.returncode != 0, proc.describe()
    assert f"checkpoint file {shard} is corrupt" in one_line(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.describe()


# ------------------------------------------------------------------------- code in a checkpoint


class _RunsCode:
    """Unpickling this runs a shell command (``os.system``)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def recompute_manifest(ckpt) -> None:
    """Make the manifest match the files, as an attacker who rewrites a checkpoint would."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for name, info in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        info.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def plant_code_in_metadata(jobs, tmp_path):
    out, ckpt = copy_of_run_b(jobs, tmp_path)
    # The payload works: plain pickle runs it.
    control = tmp_path / "control_marker"
    pickle.loads(pickle.dumps(_RunsCode(f"touch {control}")))
    assert control.exists()
    marker = tmp_path / "marker"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCode(f"touch {marker}")))
    recompute_manifest(ckpt)
    Checkpointer(ckpt.parent).verify(ckpt)  # checksums cannot help here; the loader must
    return out, ckpt, marker


def resume_in_this_process(out):
    from dufu.config import LazyConfig
    from dufu.engine.trainer import Trainer

    cfg = LazyConfig.load(str(out / "config.yaml"))
    cfg = LazyConfig.apply_overrides(cfg, [f"train.output_dir={out}", *layout("1")[1]])
    Trainer(cfg, resume=True, log=lambda *a, **k: None).train()


@pytest.mark.checkpoint_jobs("run_b")
def test_loading_never_runs_code_planted_in_the_metadata(jobs, tmp_path):
    out, ckpt, marker = plant_code_in_metadata(jobs, tmp_path)
    # (torch's CheckpointException is not an Exception subclass)
    with pytest.raises((Exception, CheckpointException), match="refusing to load"):
        Checkpointer(ckpt.parent).consolidated_model_state(ckpt)
    assert not marker.exists()
    with pytest.raises((Exception, CheckpointException), match="refusing to load"):
        resume_in_this_process(out)
    assert not marker.exists()


@pytest.mark.checkpoint_jobs("run_b")
def test_loading_never_runs_code_planted_in_the_trainer_state(jobs, tmp_path):
    out, ckpt = copy_of_run_b(jobs, tmp_path)
    marker = tmp_path / "marker"
    rank_file = ckpt / "rank_00000.pt"
    torch.save({"step": 5, "payload": _RunsCode(f"touch {marker}")}, rank_file)
    recompute_manifest(ckpt)
    with pytest.raises(CheckpointError, match="cannot be read") as info:
        resume_in_this_process(out)
    assert str(rank_file) in str(info.value)
    assert not marker.exists()


@pytest.mark.checkpoint_jobs("run_b")
def test_code_planted_in_the_metadata_is_reported_as_a_checkpoint_error(jobs, tmp_path, capsys):
    from dufu.cli import main

    out, ckpt, marker = plant_code_in_metadata(jobs, tmp_path)
    with pytest.raises(CheckpointError) as info:
        resume_in_this_process(out)
    assert str(ckpt / ".metadata") in str(info.value)
    capsys.readouterr()
    assert main(["convert", str(ckpt), "--to-torch", str(tmp_path / "x.pt")]) == 2
    assert str(ckpt / ".metadata") in one_line(capsys.readouterr().err)
    assert not marker.exists()


# ------------------------------------------------------------------------- a checkpoint of another model


def test_resuming_a_checkpoint_of_another_model_is_a_checkpoint_error(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference.output_dir, out)
    from dufu.config import LazyConfig
    from dufu.engine.trainer import Trainer

    cfg = LazyConfig.load(str(out / "config.yaml"))
    cfg = LazyConfig.apply_overrides(cfg, [f"train.output_dir={out}", "model.num_layers=3"])
    with pytest.raises(CheckpointError, match="different model") as info:
        Trainer(cfg, resume=True, log=lambda *a, **k: None).train()
    assert str(out / "checkpoints" / STEP10) in str(info.value)
