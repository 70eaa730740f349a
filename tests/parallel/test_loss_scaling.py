"""fp16 dynamic loss scaling (dufu.engine.loss_scaler) does what it claims, the same in every layout.

gpt_debug in fp16 for 6 steps, the scaler starting at 256 and growing after every 2 clean steps
(``train.amp.loss_scaler.*``), and a NaN injected into every rank's gradients at step 4
(``DUFU_FAULT=nan:*:4``, under the default ``train.nan_policy=stop``, which must not stop an fp16 run for an
overflow the scaler skips): a deterministic overflow. metrics.jsonl must show
the scale grow (x2 after steps 2 and 6), back off at the overflow (x0.5, step 4 skipped and counted) and the
run go on; dp2, tp2 and pp2 log the same scales, skips and (fp16) losses as one process, and end with its
weights. 256 keeps every scaled gradient far from fp16's overflow (65504): the only overflow is the injected one.
A run without the fault starts ZeRO-3 at a scale that overflows inside the backward: the overflow FSDP's fp32
reduction carries must reach the scaler as well.
"""

from __future__ import annotations

import pytest

from parity import PARITY_ARGS, Spec, assert_matches_reference

pytestmark = pytest.mark.multiprocess

ARGS = (*PARITY_ARGS, "train.train_iter=6", "train.checkpointer.period=6", "train.amp.enabled=True",
        "train.amp.dtype=fp16", "train.amp.loss_scaler.init_scale=256", "train.amp.loss_scaler.growth_interval=2")
FAULT = "nan:*:4"
# Scale after each step: clean steps 1-3 (growth after the 2nd), overflow at 4 (backoff, skipped), clean 5-6
# (growth after the 2nd clean step since the overflow).
EXPECTED_SCALES = [256.0, 512.0, 512.0, 256.0, 256.0, 512.0]
EXPECTED_SKIPPED = [0, 0, 0, 1, 1, 1]


OVERRIDES = ARGS[len(PARITY_ARGS):]  # what ARGS adds to PARITY_ARGS
SIZES = {"dp2": "data", "tp2": "tensor", "pp2": "pipeline"}


@pytest.fixture(scope="module")
def fp16_reference(reference_run):
    return reference_run("gpt_debug", *OVERRIDES, env=(("DUFU_FAULT", FAULT),))  # one process, in this one


@pytest.fixture(scope="module")
def fp16_runs(shared_runs):
    """The layouts' runs in one launch (tests/parity.py's SharedRuns), with the fault."""
    return shared_runs({**{layout: Spec(2, (*OVERRIDES, f"train.dist.{size}_parallel_size=2"),
                                        env=(("DUFU_FAULT", FAULT),)) for layout, size in SIZES.items()},
                        "dp2-zero3-overflow": Spec(2, (*OVERRIDES, *OVERFLOW))})


def test_the_scale_grows_backs_off_and_the_overflow_step_is_skipped(fp16_reference):
    ref = fp16_reference
    assert [r["loss_scale"] for r in ref.train.values()] == EXPECTED_SCALES
    assert [r["skipped_steps"] for r in ref.train.values()] == EXPECTED_SKIPPED
    losses = ref.losses
    assert losses[3] != losses[3] and all(x == x for i, x in enumerate(losses) if i != 3), losses  # NaN at 4 only
    assert losses[5] < losses[0]  # still training after the skipped step


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_loss_scaling_is_the_same_in_every_layout(layout, fp16_reference, fp16_runs):
    got = fp16_runs.result(layout)
    assert [r["loss_scale"] for r in got.train.values()] == EXPECTED_SCALES
    assert [r["skipped_steps"] for r in got.train.values()] == EXPECTED_SKIPPED
    assert_matches_reference(got, fp16_reference, f"fp16 {layout}", steps=6, precision="fp16")


# No injected fault: a scale so large that the first steps' fp16 gradients overflow inside the backward, under ZeRO-3
# with FSDP's mixed-precision policy (blocks gathered in fp16, their fp16 gradients cast to fp32 and reduce-scattered).
# Growth is off (interval 2000): the scale only halves, at each overflow. Measured: the first steps overflow at 2**19
# and 2**18; which later step overflows again near fp16's edge depends on the initial weights.
OVERFLOW_SCALE = 2.0**19
OVERFLOW = ("train.dist.data_parallel_size=2", "train.zero_optimization.enabled=True",
            "train.zero_optimization.stage=3", f"train.amp.loss_scaler.init_scale={int(OVERFLOW_SCALE)}",
            "train.amp.loss_scaler.growth_interval=2000")


def test_a_real_overflow_reaches_the_scaler_through_zero3s_fp32_reduction(fp16_runs):
    """An inf in a block's fp16 gradient stays inf when FSDP casts it to fp32 and reduce-scatters it: the global
    norm of the sharded fp32 gradients is not finite, the step is skipped and the scale halves; steps whose
    gradients fit train."""
    got = fp16_runs.result("dp2-zero3-overflow")
    scales = [r["loss_scale"] for r in got.train.values()]
    skipped = [r["skipped_steps"] for r in got.train.values()]
    assert skipped[0] == 1, (scales, skipped)  # the first step overflowed: no fault injected, a real inf
    assert all(b - a in (0, 1) for a, b in zip(skipped, skipped[1:])), skipped
    assert skipped[-1] <= len(skipped) - 2 and skipped[-1] == skipped[-2], skipped  # the run went on training
    assert scales == [OVERFLOW_SCALE / 2 ** n for n in skipped], scales  # halved at each skipped step, no growth
    losses = got.losses
    assert all(x == x and abs(x) != float("inf") for x in losses) and losses[-1] < losses[0], losses
