"""What a run reports and how it starts: a warm-up longer than the run is clamped with a notice, a
classification run's end summary headlines accuracy, and the stop_after_minutes verdict is broadcast from
the rank's own device (NCCL cannot broadcast a CPU tensor)."""

from __future__ import annotations

import pytest
import torch

from dufu.engine.lr_scheduler import fit_warmup_to_run
from dufu.engine.preflight import preflight
from dufu.engine.reporting.report import summary_text
from dufu_testing import load_config, train


# ------------------------------------------------------------------ warm-up longer than the run


def test_a_warmup_longer_than_the_run_is_clamped_to_it():
    node = {"_target_": "WarmupCosineLR", "warmup_iter": 30, "max_iter": 20}
    clamped, notice = fit_warmup_to_run(node, 20)
    assert clamped["warmup_iter"] == 20
    assert "train.scheduler.warmup_iter=30" in notice and "train.train_iter=20" in notice
    fitting = {"_target_": "WarmupCosineLR", "warmup_iter": 5, "max_iter": 20}
    assert fit_warmup_to_run(fitting, 20) == (fitting, None)


def test_a_short_try_of_a_recipe_runs_and_says_the_warmup_was_clamped(tmp_path):
    # gpt_debug warms up over 2 steps; a 1-step try used to stop at start-up instead.
    preflight(load_config("gpt_debug", ["train.train_iter=1", f"train.output_dir={tmp_path / 'pre'}"]), world_size=1)
    run = train(tmp_path / "run", ["train.train_iter=1", "train.checkpointer.period=0"])
    notices = [ln for line in run.log for ln in line.splitlines() if "notice" in ln]
    assert len(notices) == 1 and "warmup_iter=2 is longer than the run" in notices[0], run.log
    assert [r["step"] for r in run.records if "loss" in r] == [1]
    assert run.trainer.schedulers[0].warmup_iter == 1
    assert load_config("gpt_debug").train.scheduler.warmup_iter == 2  # the config keeps its value
    saved = (run.output_dir / "config.yaml").read_text()
    assert "warmup_iter: 2" in saved  # config.yaml reproduces the run: the clamp follows from it again


# ------------------------------------------------------------------ the end summary's headline


def test_summary_headlines_perplexity_for_language_models():
    text = summary_text({"steps": 10, "seconds": 1.0, "final_step": 10, "final_loss": 3.0,
                         "eval_ppl_start": 400.0, "eval_ppl_end": 40.0, "eval_loss_start": 6.0,
                         "eval_loss_end": 3.7}, "out")
    assert "validation ppl       400.0 -> 40.00  (10.0x lower)" in text
    assert "accuracy" not in text


def test_summary_headlines_accuracy_for_classification():
    text = summary_text({"steps": 10, "seconds": 1.0, "final_step": 10, "final_loss": 0.5,
                         "eval_ppl_start": 4.0, "eval_ppl_end": 1.5, "eval_loss_start": 1.3863,
                         "eval_loss_end": 0.4055, "eval_accuracy_start": 0.25, "eval_accuracy_end": 0.875}, "out")
    lines = text.splitlines()
    accuracy = next(i for i, line in enumerate(lines) if "validation accuracy" in line)
    assert lines[accuracy].split() == ["validation", "accuracy", "25.0%", "->", "87.5%"]
    assert lines[accuracy + 1].split() == ["validation", "loss", "1.3863", "->", "0.4055"]  # secondary
    assert "validation ppl" not in text


def test_a_classification_run_reports_accuracy_start_and_end(tmp_path):
    run = train(tmp_path / "run", ["train.train_iter=2", "train.checkpointer.period=0",
                                   "train.evaluation.enabled=True", "train.evaluation.eval_iter=1"],
                recipe="vit_debug")
    s = run.summary
    evals = [r for r in run.records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert (s["eval_accuracy_start"], s["eval_accuracy_end"]) == (evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"])
    assert (s["eval_loss_start"], s["eval_loss_end"]) == (evals[0]["eval_loss"], evals[-1]["eval_loss"])
    summary = run.log[-1]
    assert "validation accuracy" in summary and "validation loss" in summary and "validation ppl" not in summary


# ------------------------------------------------------------------ collectives on the rank's device


class Broadcast(Exception):
    """Raised by the fake broadcast once it has seen the tensor (a meta tensor has no value to go on with)."""


def test_stop_after_minutes_broadcasts_on_the_trainers_device(debug_run, monkeypatch):
    import torch.distributed as dist

    trainer = debug_run.trainer
    seen = []

    def fake_broadcast(tensor, src, *args, **kwargs):
        seen.append(tensor.device)
        raise Broadcast

    monkeypatch.setattr(dist, "broadcast", fake_broadcast)
    monkeypatch.setitem(trainer.cfg.train, "stop_after_minutes", 1e-9)
    # Two ranks, mid-run, on a device that is not the CPU (meta stands in for a GPU on a CPU-only machine).
    monkeypatch.setattr(trainer.runtime, "world_size", 2)
    monkeypatch.setattr(trainer, "step", 3)
    monkeypatch.setattr(trainer.runtime, "device", torch.device("meta"))
    monkeypatch.setattr(trainer.preemption, "requested", lambda *args: None)  # its own gloo all-reduce: no group here
    with pytest.raises(Broadcast):
        trainer._stop_reason(t_start=0.0)
    assert seen == [torch.device("meta")]
