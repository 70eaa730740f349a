"""A training step reads no tensor value on the host: the loop reads its steps' numbers once per log period
(dufu.engine.step_stats), and a non-finite gradient's update is dropped on the device (found_inf)."""

from __future__ import annotations

import math

import pytest
import torch

from dufu.engine.hooks import Hook
from dufu.engine.host_reads import count_host_reads
from dufu_testing import FAST, load_config, read_records

STEPS, LOG_PERIOD = 10, 5


class ReadsPerStep(Hook):
    """Host reads from the start of each step to the start of the next (the loop's read, logging and all)."""

    def __init__(self):
        self.per_step, self._counter, self._reads = [], None, None

    def _close(self):
        if self._counter is not None:
            self.per_step.append((self._reads.count, dict(self._reads.by_site)))
            self._counter.__exit__(None, None, None)
            self._counter = None

    def on_step_start(self, trainer):
        self._close()
        self._counter = count_host_reads()
        self._reads = self._counter.__enter__()

    def on_end(self, trainer, summary):  # the last step's window also holds the end summary: not counted
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None


def _train(tmp_path, recipe, overrides=(), hooks=()):
    from dufu.engine.trainer import Trainer

    cfg = load_config(recipe, [*FAST, f"train.train_iter={STEPS}", f"train.log_period={LOG_PERIOD}",
                               "train.checkpointer.period=0", "train.evaluation.enabled=false",
                               f"train.output_dir={tmp_path / 'run'}", *overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None, hooks=hooks)
    return trainer, trainer.train()


def test_steps_read_nothing_on_the_host_but_once_per_log_period(tmp_path):
    counter = ReadsPerStep()
    trainer, _ = _train(tmp_path, "gpt_debug", hooks=[counter])
    # steps 1 .. 9 (step 10's window holds the end summary): one read at step 5, where the record is written
    counts = [n for n, _ in counter.per_step]
    assert len(counts) == STEPS - 1
    sites = [s for _, s in counter.per_step]
    assert counts[LOG_PERIOD - 1] == 1, sites[LOG_PERIOD - 1]
    assert all(n == 0 for i, n in enumerate(counts) if i != LOG_PERIOD - 1), sites
    # and what was read is what a read every step would have given: the records hold finite numbers of steps 5, 10
    records = [r for r in read_records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in records] == [5, 10]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)


def test_a_log_period_does_not_change_what_is_logged(tmp_path):
    """The numbers of step 5 and 10 are the same with a read every step (log_period=1)."""
    _train(tmp_path / "every", "gpt_debug", ["train.log_period=1"])
    _train(tmp_path / "fifth", "gpt_debug")
    every = {r["step"]: r for r in read_records(tmp_path / "every" / "run") if "loss" in r}
    fifth = {r["step"]: r for r in read_records(tmp_path / "fifth" / "run") if "loss" in r}
    for step in (5, 10):
        assert fifth[step]["loss"] == every[step]["loss"]
        assert fifth[step]["grad_norm"] == every[step]["grad_norm"]


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_non_finite_gradient_between_reads(tmp_path, monkeypatch, policy):
    """A NaN gradient at step 3 with reads at steps 5 and 10: under "skip" the update is dropped on the device
    (the run's later steps equal those of a run with the same skip read every step); under "stop" the run stops
    at the read of step 5, naming step 3."""
    from dufu.errors import DufuError

    monkeypatch.setenv("DUFU_FAULT", "nan:0:3")
    if policy == "stop":
        with pytest.raises(DufuError, match=r"step 3\b.*gradient norm is nan \(read at step 5"):
            _train(tmp_path / "a", "gpt_debug")
        assert not [r for r in read_records(tmp_path / "a" / "run") if "loss" in r]  # stopped before any record
        return
    trainer, _ = _train(tmp_path / "a", "gpt_debug", ["train.nan_policy=skip"])
    _train(tmp_path / "b", "gpt_debug", ["train.nan_policy=skip", "train.log_period=1"])
    # the fused optimizer took 9 of the 10 steps (its step count too) and every weight is finite
    opt = trainer.optimizers[0]
    assert {float(opt.state[p]["step"]) for g in opt.param_groups for p in g["params"]} == {STEPS - 1.0}
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    a = {r["step"]: r for r in read_records(tmp_path / "a" / "run") if "loss" in r}
    b = {r["step"]: r for r in read_records(tmp_path / "b" / "run") if "loss" in r}
    assert not math.isfinite(b[3]["grad_norm"]) and b[3]["skipped_steps"] == 1
    for step in (5, 10):
        assert a[step]["skipped_steps"] == 1
        assert a[step]["loss"] == b[step]["loss"] and a[step]["grad_norm"] == b[step]["grad_norm"]


def test_the_counter_sees_each_kind_of_read():
    t = torch.ones(3)
    with count_host_reads() as reads:
        t.sum().item(), t.tolist(), float(t[0]), int(t[1]), bool(t[2] > 0)
        with reads.paused():
            t.sum().item()
    assert reads.count == 5
    assert torch.Tensor.item.__name__ == "item" and reads.by_site
    t.sum().item()  # restored: no longer counted
    assert reads.count == 5
