"""Sharded checkpoints of a 4-process run, resumed in other layouts; stopping early and continuing.

Run A (``reference``): 1 process, 10 uninterrupted steps. Run B: the same training at dp 2 x tp 2 on 4
processes, stopped by ``train.stop_at_iter=5``. Copies of B are resumed with ``--resume`` (B's
config.yaml plus new ``train.dist`` overrides) at tp 4, pp 2, dp 4 with ZeRO 3, tp 2 x pp 2 and on one
process; each must log steps 6..10 with A's losses and learning rates.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import defaultdict

import pytest
import torch

from checkpoint_runs import RESUME_TARGETS, checkpoint_names, consolidated, layout
from launch import assert_ok
from parity import assert_checkpoint_matches, assert_losses_match, records, train_records
from dufu.config import LazyConfig
from dufu.engine.weights.checkpoint import MANIFEST, Checkpointer, SafeFileSystemReader

pytestmark = pytest.mark.multiprocess

STEP5 = "step_0000005"


def run_b(jobs):
    b = jobs.result("run_b")
    assert_ok(b)
    return b


@pytest.mark.checkpoint_jobs("run_b")
def test_a_four_process_checkpoint_holds_every_rank_shards_state_config_and_manifest(jobs):
    b = run_b(jobs)
    ckpt = b.output_dir / "checkpoints" / STEP5
    names = {p.name for p in ckpt.iterdir()}
    shards = {f"__{r}_0.distcp" for r in range(4)}
    rank_files = {f"rank_{r:05d}.pt" for r in range(4)}
    assert names == {".metadata", MANIFEST, "config.yaml", *shards, *rank_files}

    # The manifest lists every other file with its size and SHA-256.
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert set(manifest["files"]) == names - {MANIFEST}
    for name, info in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert info["bytes"] == len(data) > 0, name
        assert info["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert manifest["step"] == 5 and manifest["world_size"] == 4
    assert "dp 2 x tp 2" in manifest["layout"]
    assert Checkpointer(ckpt.parent).verify(ckpt)["step"] == 5

    # Every rank wrote its own shards: each file holds tensor data, and a tensor-parallel weight is split
    # over two files (two ranks), none of which holds all of it.
    metadata = SafeFileSystemReader(str(ckpt)).read_metadata()
    items_per_file = defaultdict(int)
    for info in metadata.storage_data.values():
        items_per_file[info.relative_path] += 1
    assert set(items_per_file) == shards and min(items_per_file.values()) > 0
    fc1 = "model.blocks.0.mlp.fc1.weight"  # column-parallel: rows split over the two tp ranks
    full_rows = metadata.state_dict_metadata[fc1].size[0]
    chunks = metadata.state_dict_metadata[fc1].chunks
    assert len(chunks) == 2 and all(c.sizes[0] == full_rows // 2 for c in chunks)
    files = {info.relative_path for idx, info in metadata.storage_data.items() if idx.fqn == fc1}
    assert len(files) == 2

    # Per-rank trainer state, and the run's config (which alone reproduces it).
    for name in rank_files:
        state = torch.load(ckpt / name, weights_only=True)
        assert state["step"] == 5 and state["sampler"]["consumed_samples"] == 5 * 8
    cfg = LazyConfig.load(str(ckpt / "config.yaml"))
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (64, 2)
    assert (cfg.train.dist.data_parallel_size, cfg.train.dist.tensor_parallel_size) == (2, 2)


@pytest.mark.checkpoint_jobs("run_b")
def test_the_four_process_checkpoint_holds_the_single_process_weights(jobs, reference):
    b = run_b(jobs)
    sharded = consolidated(b.output_dir / "checkpoints" / STEP5)
    assert_checkpoint_matches(sharded, reference.output_dir, 5, "run B (dp 2 x tp 2), step 5")


@pytest.mark.checkpoint_jobs("run_b")
def test_stop_at_iter_writes_a_complete_checkpoint_and_says_how_to_continue(jobs, reference):
    b = run_b(jobs)
    assert checkpoint_names(b.output_dir) == [STEP5]  # committed, nothing partial left over
    Checkpointer(b.output_dir / "checkpoints").verify(b.output_dir / "checkpoints" / STEP5)
    assert sorted(train_records(b.output_dir)) == [1, 2, 3, 4, 5]
    assert "stopped at step 5 of 10: train.stop_at_iter=5" in b.stdout
    assert f"dufu train {b.output_dir / 'config.yaml'} --nproc 4 --resume" in b.stdout
    # The schedule is still the 10-step one: same losses and learning rates as run A so far.
    assert_losses_match(b.output_dir, reference.output_dir, range(1, 6))
    ref = train_records(reference.output_dir)
    assert [r["lr"] for r in train_records(b.output_dir).values()] == [ref[s]["lr"] for s in range(1, 6)]


def check_resumed(output_dir, stdout: str, reference) -> None:
    assert f"resumed from {output_dir / 'checkpoints' / STEP5} (step 5)" in stdout
    got = train_records(output_dir)  # also: no step logged twice
    assert sorted(got) == list(range(1, 11))
    assert_losses_match(output_dir, reference.output_dir, range(6, 11))
    ref = train_records(reference.output_dir)
    for s in range(6, 11):  # the LR schedule continues unchanged
        assert got[s]["lr"] == pytest.approx(ref[s]["lr"], rel=1e-12, abs=1e-15), s
    assert checkpoint_names(output_dir) == [STEP5, "step_0000010"]


@pytest.mark.parametrize(
    "target", [pytest.param(t, marks=pytest.mark.checkpoint_jobs(f"resume_{t}")) for t in RESUME_TARGETS]
)
def test_resume_a_dp2_tp2_checkpoint_in_another_layout(target, jobs, reference):
    proc = jobs.result(f"resume_{target}")
    assert_ok(proc)
    check_resumed(proc.output_dir, proc.stdout, reference)
    manifest = json.loads((proc.output_dir / "checkpoints" / "step_0000010" / MANIFEST).read_text())
    assert manifest["world_size"] == layout(target)[0]


@pytest.mark.checkpoint_jobs("run_b")
def test_resume_a_dp2_tp2_checkpoint_in_one_process(jobs, reference, tmp_path, capsys):
    from dufu.cli import main

    b = run_b(jobs)
    out = tmp_path / "resume_1"
    shutil.copytree(b.output_dir, out)
    _, dist = layout("1")
    assert main(["train", str(out / "config.yaml"), "--resume", f"train.output_dir={out}", *dist]) == 0
    check_resumed(out, capsys.readouterr().out, reference)


@pytest.mark.checkpoint_jobs("stop_minutes")
def test_stop_after_minutes_stops_every_rank_after_the_first_step(jobs):
    proc = jobs.result("stop_minutes")
    assert_ok(proc)
    out = proc.output_dir
    assert sorted(train_records(out)) == [1]
    assert [r["step"] for r in records(out)] == [1]
    assert checkpoint_names(out) == ["step_0000001"]
    ckpt = out / "checkpoints" / "step_0000001"
    assert Checkpointer(ckpt.parent).verify(ckpt)["world_size"] == 2
    # Both ranks stopped at the same step and saved it (otherwise the save would have hung or failed).
    for r in range(2):
        assert torch.load(ckpt / f"rank_{r:05d}.pt", weights_only=True)["step"] == 1
    assert "stopped at step 1 of 10: train.stop_after_minutes=" in proc.stdout
    assert f"dufu train {out / 'config.yaml'} --nproc 2 --resume" in proc.stdout
