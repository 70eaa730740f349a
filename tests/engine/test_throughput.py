"""The arithmetic of logged throughput: a log window's tokens/s, seconds per step and MFU, and the clock that
takes every rank's steps into a window (the slowest rank's, without evaluations and checkpoint saves).
Multi-process runs of the same are in test_throughput_layouts.py."""

from __future__ import annotations

import pytest

from dufu.engine.reporting.report import StepClock, window_rates


def test_window_rates_count_global_tokens_over_the_window_and_every_device_in_mfu():
    rates = window_rates(tokens_per_step=1024, steps=4, seconds=2.0, flops_per_token=3e6, peak_flops=1e11,
                         world_size=4)
    assert rates["tokens_per_s"] == 2048.0  # 4 x 1024 tokens in 2 s
    assert rates["step_time_s"] == 0.5
    assert rates["mfu"] == pytest.approx(3e6 * 2048 / (1e11 * 4))  # the peak of all 4 devices
    one = window_rates(1024, 4, 2.0, 3e6, 1e11, world_size=1)
    assert one["tokens_per_s"] == rates["tokens_per_s"] and one["mfu"] == pytest.approx(4 * rates["mfu"])


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class OtherRanks:
    """reduce_max as the all-reduce would give it, with the other ranks' windows queued in advance."""

    def __init__(self, *windows):
        self.windows, self.seen = list(windows), []

    def __call__(self, own):
        self.seen.append(own)
        return max(own, self.windows.pop(0))


def test_the_window_is_the_slowest_ranks_and_leaves_out_evaluation_and_checkpoints():
    t = FakeClock()
    others = OtherRanks(0.0, 1.5, 0.2)  # start (a synchronisation), then two windows
    clock = StepClock(reduce_max=others, clock=t)
    assert clock.start() == 100.0

    t.advance(1.0)   # this rank's step 1
    clock.step_done()
    t.advance(0.25)  # step 2 (log period 2): this rank took 1.25 s, another rank 1.5 s
    assert clock.window() == 1.5
    assert others.seen[-1] == 1.25
    clock.step_done()

    t.advance(0.5)   # step 3
    clock.step_done()
    t.advance(7.0)   # an evaluation ...
    clock.pause()
    t.advance(3.0)   # ... and a checkpoint save after step 3
    clock.pause()
    t.advance(0.5)   # step 4
    assert clock.window() == 1.0  # 2 steps of 0.5 s; the other ranks were faster (0.2)
    assert others.seen == [0.0, 1.25, 1.0]


def test_one_process_times_its_own_steps():
    t = FakeClock()
    clock = StepClock(reduce_max=lambda own: own, clock=t)
    clock.start()
    for seconds in (0.5, 0.75):
        t.advance(seconds)
        assert clock.window() == seconds
        clock.step_done()
