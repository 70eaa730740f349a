"""End-to-end training runs of the gpt_debug recipe, in-process: outputs, exact resume, reproduction
from config.yaml, activation checkpointing, gradient accumulation and mixed precision."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from dufu.config import LazyConfig
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.models.gpt import GPTModel
from dufu.parallel import apply_activation_checkpointing
from dufu_testing import DEBUG_RUN_OVERRIDES, load_config, read_records, train, train_config

LOG_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu")


# ------------------------------------------------------------------ what a run writes


def test_a_run_writes_every_output(debug_run):
    out = debug_run.output_dir
    for name in ("config.yaml", "metrics.jsonl", "loss.png"):
        assert (out / name).is_file(), name

    trainer = debug_run.trainer
    records = read_records(out)
    train_recs = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_recs] == list(range(1, 11))
    for r in train_recs:
        for key in LOG_KEYS:
            assert key in r, f"metrics record of step {r['step']} lacks {key!r}"
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r[key])
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["grad_norm"] > 0 and r["lr"] >= 0
        assert r["consumed_samples"] == 4 * r["step"]  # global batch 4
        # log_period 1: each record covers one step of 4 x 32 tokens; MFU = model FLOP/s / peak FLOP/s
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"], rel=1e-6)
        assert r["mfu"] == pytest.approx(trainer.runtime.flops_per_token * r["tokens_per_s"] / trainer.runtime.peak_flops, rel=1e-6)
    assert abs(train_recs[0]["loss"] - math.log(384)) < 0.5
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 5, 10]
    for r in evals:
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]

    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_0000005", "step_0000010"]
    for name in checkpoints:
        manifest = json.loads((out / "checkpoints" / name / "manifest.json").read_text())
        assert manifest["step"] == int(name.split("_")[1])
        assert any(f.endswith(".distcp") for f in manifest["files"])

    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    data = events[0].read_bytes()
    assert b"train/loss" in data and b"eval/eval_loss" in data

    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    saved = LazyConfig.load(out / "config.yaml")
    assert saved.train.output_dir == str(out) and saved.train.train_iter == 10

    s = debug_run.summary
    assert s["final_step"] == 10 and s["steps"] == 10
    assert s["final_loss"] == train_recs[-1]["loss"]
    assert s["eval_ppl_end"] < s["eval_ppl_start"]
    assert len(s["samples"]) == 1 and s["samples"][0][0] == "The " and len(s["samples"][0][1]) > 0


# ------------------------------------------------------------------ resume and reproduction


def resume_copy(copy_run, keep_step: int = 5) -> Path:
    """A copy of the debug run with only the checkpoint of ``keep_step`` left."""
    out = copy_run()
    for p in (out / "checkpoints").iterdir():
        if p.name != f"step_{keep_step:07d}":
            shutil.rmtree(p)
    return out


def test_resume_continues_exactly(debug_run, copy_run):
    out = resume_copy(copy_run)
    resumed = train_config(load_config("gpt_debug", DEBUG_RUN_OVERRIDES), out, resume=True)
    assert any("resumed from" in line and "step_0000005" in line for line in resumed.log)
    a, b = debug_run.losses, resumed.losses
    assert sorted(b) == list(range(1, 11))  # records after the checkpoint were replaced, none duplicated
    for step in range(6, 11):
        assert b[step] == a[step], f"step {step}: resumed loss {b[step]!r} != uninterrupted {a[step]!r}"
    evals = lambda recs: {r["step"]: r["eval_loss"] for r in recs if "eval_loss" in r}  # noqa: E731
    assert evals(resumed.records) == evals(debug_run.records)
    # The final weights are identical too.
    final_a, final_b = debug_run.trainer.model.state_dict(), resumed.trainer.model.state_dict()
    assert final_a.keys() == final_b.keys()
    for k in final_a:
        assert torch.equal(final_a[k], final_b[k]), k


def test_resume_ignores_a_partial_checkpoint(debug_run, copy_run):
    out = resume_copy(copy_run)
    partial = out / "checkpoints" / ".step_0000010.partial"  # a save that crashed half-way
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a checkpoint")
    assert Checkpointer(out / "checkpoints").latest().name == "step_0000005"
    resumed = train_config(
        load_config("gpt_debug", [*DEBUG_RUN_OVERRIDES, "train.tensorboard=False",
                                  "train.evaluation.enabled=False", "train.generation.enabled=False"]),
        out, resume=True,
    )
    assert any("step_0000005" in line for line in resumed.log)
    assert {s: resumed.losses[s] for s in range(6, 11)} == {s: debug_run.losses[s] for s in range(6, 11)}
    assert not partial.exists()  # the new step-10 save replaced the leftover
    assert (out / "checkpoints" / "step_0000010" / "manifest.json").is_file()


def test_resume_with_dropout_restores_the_random_state(debug_run, tmp_path):
    dropout = ["model.embedding_dropout=0.1", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    overrides = ["train.train_iter=6", "train.checkpointer.period=3", *dropout]
    full = train(tmp_path / "full", overrides)
    shutil.copytree(full.output_dir, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_0000006")
    resumed = train(tmp_path / "resumed", overrides, resume=True)
    assert resumed.losses == full.losses  # steps 4-6 redrawn with the same dropout masks
    # Dropout is really on: the first step (same seed, weights and batch) differs from the run without it.
    assert full.losses[1] != debug_run.losses[1]


def test_config_yaml_alone_reproduces_the_run(debug_run, tmp_path):
    cfg = LazyConfig.load(debug_run.output_dir / "config.yaml")
    again = train_config(cfg, tmp_path / "again")
    assert again.losses == debug_run.losses  # exactly, step for step
    evals = lambda run: [(r["step"], r["eval_loss"]) for r in run.records if "eval_loss" in r]  # noqa: E731
    assert evals(again) == evals(debug_run)
    first = (debug_run.output_dir / "config.yaml").read_text()
    second = (tmp_path / "again" / "config.yaml").read_text()
    assert second == first.replace(str(debug_run.output_dir), str(tmp_path / "again"))


def test_existing_run_is_not_overwritten_without_resume(debug_run, copy_run):
    from dufu.errors import DufuError
    from dufu_testing import snapshot

    out = copy_run()
    before = snapshot(out)
    with pytest.raises(DufuError, match="already holds a run"):
        train_config(load_config("gpt_debug", DEBUG_RUN_OVERRIDES), out)
    assert snapshot(out) == before


# ------------------------------------------------------------------ layout-invariant numerics


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Memoised 3-step runs: ``runs(*overrides)``; each distinct override list trains once per module."""
    cache = {}

    def get(*overrides):
        if overrides not in cache:
            out = tmp_path_factory.mktemp("run") / "out"
            cache[overrides] = train(out, ["train.train_iter=3", "train.checkpointer.period=0", *overrides])
        return cache[overrides]

    return get


def assert_same_params(model_a, model_b, rtol=0.0, atol=0.0):
    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        torch.testing.assert_close(sd_a[k], sd_b[k], rtol=rtol, atol=atol, msg=k)


def test_gradient_accumulation_equals_one_large_micro_batch(runs):
    accumulated = runs("train.train_micro_batch_size=2", "train.global_batch_size=8")
    single = runs("train.train_micro_batch_size=8", "train.global_batch_size=8")
    assert accumulated.trainer.runtime.num_accumulation_steps == 4 and single.trainer.runtime.num_accumulation_steps == 1
    la, ls = accumulated.losses, single.losses
    assert sorted(la) == sorted(ls) == [1, 2, 3]
    for step in la:
        assert la[step] == pytest.approx(ls[step], rel=1e-5), step
    assert_same_params(accumulated.trainer.model, single.trainer.model, rtol=1e-5, atol=1e-6)
    # ... and the runs did train: the parameters moved away from their initial values
    torch.manual_seed(1234)  # gpt_debug's train.seed
    init = GPTModel(**{k: v for k, v in load_config().model.items() if k != "_target_"})
    assert not torch.allclose(init.blocks["0"].mlp.fc1.weight, single.trainer.model.blocks["0"].mlp.fc1.weight)


def test_activation_checkpointing_gives_same_loss_and_gradients():
    kw = dict(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    plain = GPTModel(**kw)
    torch.manual_seed(0)
    checkpointed = apply_activation_checkpointing(GPTModel(**kw))
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()  # names unchanged
    tokens = torch.randint(0, 257, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (plain, checkpointed):
        loss = m(tokens[:, :-1], shift_labels=tokens[:, 1:]).loss
        loss.backward()
        losses.append(loss)
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    grads = dict(checkpointed.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-6), name


def test_activation_checkpointing_training_run_matches(runs):
    base = runs("train.train_micro_batch_size=8", "train.global_batch_size=8")
    ac = runs("train.train_micro_batch_size=8", "train.global_batch_size=8", "train.activation_checkpoint.enabled=True")
    assert ac.losses.keys() == base.losses.keys()
    for step, loss in base.losses.items():
        assert ac.losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), step
    assert_same_params(ac.trainer.model, base.trainer.model, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_trains(dtype, train_run):
    run = train_run("train.train_iter=20", "train.checkpointer.period=0", "train.amp.enabled=True",
                    f"train.amp.dtype={dtype}")
    records = [r for r in run.records if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(384)) < 0.5
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, f"{dtype}: loss did not fall ({first:.3f} -> {last:.3f})"
    if dtype == "fp16":
        assert all(r["loss_scale"] > 0 and math.isfinite(r["loss_scale"]) for r in records)
    else:
        assert not any("loss_scale" in r for r in records)  # bf16 needs no loss scaling
    # parameters stay fp32 (autocast only lowers the matmuls)
    assert all(p.dtype == torch.float32 for p in run.trainer.model.parameters())


# ------------------------------------------------------------------ metrics and start-up checks


def test_logged_lr_is_the_lr_of_that_step(debug_run):
    # gpt_debug: lr 1e-3, warmup_iter 2, warmup_factor 0, cosine to 0.1 at train_iter 10.
    from dufu.engine.lr_scheduler import WarmupCosineLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = WarmupCosineLR(opt, max_iter=10, warmup_iter=2, warmup_factor=0.0, min_lr_ratio=0.1)
    applied = []
    for _ in range(10):
        applied.append(opt.param_groups[0]["lr"])  # the lr optimizer.step() uses for this step
        opt.step()
        sched.step()
    logged = [r["lr"] for r in debug_run.records if "loss" in r]
    assert logged == pytest.approx(applied)


def test_too_small_validation_set_fails_before_writing(tmp_path):
    from dufu.errors import ConfigError

    out = tmp_path / "run"
    # gpt_debug's validation split has 176 samples: fewer than one global batch of 256.
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        train(out, ["train.evaluation.enabled=True", "train.train_micro_batch_size=64",
                    "train.global_batch_size=256", "train.train_iter=2"])
    assert not out.exists()
