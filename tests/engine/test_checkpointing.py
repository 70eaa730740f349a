"""Checkpoints: manifest, verification of every file, atomic commit, pruning, round trip."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from torch import nn

from dufu.engine.weights.checkpoint import MANIFEST, Checkpointer
from dufu.errors import CheckpointError
from dufu_testing import DEBUG_RUN_OVERRIDES, load_config, snapshot, train_config

NO_EXTRAS = ("train.tensorboard=False", "train.evaluation.enabled=False", "train.generation.enabled=False")


def test_manifest_lists_every_file_with_size_and_checksum(debug_run):
    for ckpt in sorted((debug_run.output_dir / "checkpoints").iterdir()):
        manifest = json.loads((ckpt / MANIFEST).read_text())
        on_disk = {p.name for p in ckpt.iterdir() if p.is_file() and p.name != MANIFEST}
        assert set(manifest["files"]) == on_disk
        assert ".metadata" in on_disk and "rank_00000.pt" in on_disk
        assert any(name.endswith(".distcp") for name in on_disk)
        for name, info in manifest["files"].items():
            data = (ckpt / name).read_bytes()
            assert info["bytes"] == len(data) > 0
            assert info["sha256"] == hashlib.sha256(data).hexdigest()
        assert manifest["world_size"] == 1
        assert Checkpointer(ckpt.parent).verify(ckpt)["step"] == manifest["step"]


def corrupt_one_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_from_corrupt_checkpoint_fails_naming_the_file(copy_run):
    out = copy_run()
    distcp = sorted((out / "checkpoints" / "step_0000010").glob("*.distcp"))[0]
    corrupt_one_byte(distcp)
    before = snapshot(out)
    cfg = load_config("gpt_debug", [*DEBUG_RUN_OVERRIDES, *NO_EXTRAS])
    with pytest.raises(CheckpointError) as info:
        train_config(cfg, out, resume=True)
    msg = str(info.value)
    assert str(distcp) in msg and "corrupt" in msg and "checksum" in msg
    assert snapshot(out) == before  # nothing was written


def test_ranks_share_the_hashing_and_one_finding_is_enough(copy_run):
    """A job's ranks hash disjoint shares of the files (verify_together): of two shares exactly one holds the
    corrupted file, and the two together cover every file."""
    out = copy_run()
    ckpt = out / "checkpoints" / "step_0000010"
    checkpointer = Checkpointer(out / "checkpoints")
    corrupt_one_byte(sorted(ckpt.glob("*.distcp"))[0])
    found = []
    for share in ((0, 2), (1, 2)):
        try:
            checkpointer.verify(ckpt, share=share)
        except CheckpointError as e:
            found.append(str(e))
    assert len(found) == 1 and "checksum" in found[0]


def test_truncated_and_missing_files_are_reported(copy_run):
    out = copy_run()
    ckpt = out / "checkpoints" / "step_0000010"
    checkpointer = Checkpointer(out / "checkpoints")
    rank_file = ckpt / "rank_00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated") as info:
        checkpointer.verify(ckpt)
    assert str(rank_file) in str(info.value)
    rank_file.unlink()
    with pytest.raises(CheckpointError, match="missing") as info:
        checkpointer.verify(ckpt)
    assert str(rank_file) in str(info.value)
    (ckpt / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest"):
        checkpointer.verify(ckpt)


def test_only_complete_checkpoints_count(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_0000003").mkdir(parents=True)
    (root / "step_0000003" / MANIFEST).write_text("{}")
    (root / ".step_0000009.partial").mkdir()  # interrupted save
    (root / ".step_0000009.partial" / MANIFEST).write_text("{}")
    (root / "step_0000007").mkdir()  # no manifest: incomplete
    (root / "not_a_step").mkdir()
    c = Checkpointer(root)
    assert [s for s, _ in c.complete_checkpoints()] == [3]
    assert c.latest() == root / "step_0000003"
    assert Checkpointer(tmp_path / "nothing").latest() is None
    with pytest.raises(CheckpointError, match="incomplete"):
        c.verify(root / "step_0000007")
    with pytest.raises(CheckpointError, match="does not exist"):
        c.verify(root / "step_0000042")


def tiny_model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_save_load_round_trip_and_pruning(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, max_to_keep=2)
    model, opt = tiny_model_and_optimizer(0)
    for step in (1, 2, 3):
        path = ckpt.save(step, model, opt, {"step": step, "note": torch.tensor([step])})
        assert path == root / f"step_{step:07d}"
        assert not list(root.glob(".*partial"))  # the temporary directory was renamed
    assert [s for s, _ in ckpt.complete_checkpoints()] == [2, 3]  # max_to_keep=2 pruned step 1

    other, other_opt = tiny_model_and_optimizer(1)  # different weights and optimizer state
    assert not torch.equal(other[0].weight, model[0].weight)
    state = ckpt.load(ckpt.latest(), other, other_opt)
    assert state["step"] == 3 and torch.equal(state["note"], torch.tensor([3]))
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), other.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], other_opt.state[q][key])


def test_resaving_a_step_replaces_it(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints")
    model, opt = tiny_model_and_optimizer(0)
    first = ckpt.save(5, model, opt, {"step": 5})
    with torch.no_grad():
        model[0].weight.add_(1.0)
    second = ckpt.save(5, model, opt, {"step": 5})
    assert first == second and ckpt.verify(second)["step"] == 5
    fresh, fresh_opt = tiny_model_and_optimizer(3)
    ckpt.load(second, fresh, fresh_opt)
    assert torch.equal(fresh[0].weight, model[0].weight)
