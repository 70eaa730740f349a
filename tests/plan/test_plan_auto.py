"""`dufu train` with auto layout values: the planner's best layout is run and the start-up summary says so."""

from __future__ import annotations

import pytest

from plan_testing import GPT30M, load
from dufu.errors import ConfigError
from dufu.plan.auto import resolve_auto_layout


def test_auto_values_are_replaced_by_the_best_layout(test_cpu):
    cfg = load("gpt_debug", *GPT30M, "train.dist.auto=True", "train.global_batch_size=16")
    notice = resolve_auto_layout(cfg, 4, test_cpu)
    t = cfg.train
    assert t.dist.auto is False
    assert t.dist.data_parallel_size * t.dist.tensor_parallel_size * t.dist.pipeline_parallel_size == 4
    assert isinstance(t.train_micro_batch_size, int) and 16 % (t.train_micro_batch_size * t.dist.data_parallel_size) == 0
    assert isinstance(t.activation_checkpoint.enabled, bool) and t.zero_optimization.stage in (1, 2, 3)
    assert notice.startswith("layout chosen by the planner for train.dist.auto=True: dp ")
    assert "predicted" in notice and "best of" in notice


def test_without_auto_nothing_changes(test_cpu):
    cfg = load("gpt_debug")
    before = repr(cfg)
    assert resolve_auto_layout(cfg, 2, test_cpu) is None and repr(cfg) == before


def test_auto_micro_batch_without_global_batch_is_refused(test_cpu):
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        resolve_auto_layout(load("gpt_debug", "train.train_micro_batch_size=auto"), 1, test_cpu)


def test_a_run_with_auto_values_says_which_layout_it_chose(tmp_path, capsys):
    import json

    from dufu.cli import main
    from dufu_testing import FAST

    out = tmp_path / "run"
    assert main(["train", "gpt_debug", *FAST, f"train.output_dir={out}", "train.train_iter=2",
                 "train.train_micro_batch_size=auto", "train.global_batch_size=8",
                 "train.activation_checkpoint.enabled=auto"]) == 0
    summary = capsys.readouterr().out
    assert "layout chosen by the planner for auto train_micro_batch_size, activation_checkpoint.enabled" in summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(records) == 2


def test_a_trainer_built_by_hand_refuses_unresolved_auto_values(tmp_path):
    from dufu.engine.trainer import Trainer

    cfg = load("gpt_debug", "train.train_micro_batch_size=auto", f"train.output_dir={tmp_path}")
    with pytest.raises(ConfigError, match="resolve_auto_layout"):
        Trainer(cfg)


def test_a_searched_layout_applied_to_the_config_is_estimated_alike(test_cpu):
    from dufu.plan import apply_layout, estimate, search

    cfg = load("gpt_debug", *GPT30M, "train.dist.data_parallel_size=auto", "train.dist.pipeline_parallel_size=auto",
               "train.train_micro_batch_size=auto", "train.global_batch_size=16")
    plan = search(cfg, 4, test_cpu)
    for candidate in plan[:3]:
        again = estimate(apply_layout(cfg, candidate.layout), 4, test_cpu)
        assert again.layout == candidate.layout
        assert again.step_time_s == candidate.step_time_s
        assert again.memory_per_gpu_bytes == candidate.memory_per_gpu_bytes
