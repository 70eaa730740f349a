"""fp16 dynamic loss scaling (dufu.engine.loss_scaler) does what it claims, the same in every layout.

gpt_debug in fp16 for 6 steps, the scaler starting at 256 and growing after every 2 clean steps
(``train.amp.loss_scaler.*``), and a NaN injected into every rank's gradients at step 4
(``DUFU_FAULT=nan:*:4``, under the default ``train.nan_policy=stop``, which must not stop an fp16 run for an
overflow the scaler skips): a deterministic overflow. metrics.jsonl must show
the scale grow (x2 after steps 2 and 6), back off at the overflow (x0.5, step 4 skipped and counted) and the
run go on; dp2, tp2 and pp2 log the same scales, skips and (fp16) losses as one process, and end with its
weights. 256 keeps every scaled gradient far from fp16's overflow (65504): the only overflow is the injected one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import launch
from parity import PARITY_ARGS, assert_matches_reference, collect

pytestmark = pytest.mark.multiprocess

ARGS = (*PARITY_ARGS, "train.train_iter=6", "train.checkpointer.period=6", "train.amp.enabled=True",
        "train.amp.dtype=fp16", "train.amp.loss_scaler.init_scale=256", "train.amp.loss_scaler.growth_interval=2")
FAULT = "nan:*:4"
# Scale after each step: clean steps 1-3 (growth after the 2nd), overflow at 4 (backoff, skipped), clean 5-6
# (growth after the 2nd clean step since the overflow).
EXPECTED_SCALES = [256.0, 512.0, 512.0, 256.0, 256.0, 512.0]
EXPECTED_SKIPPED = [0, 0, 0, 1, 1, 1]


def fp16_run(out: Path, nproc: int, *overrides: str):
    cmd = launch.train_command("gpt_debug", out, nproc, *ARGS, *overrides)
    launch.assert_ok(launch.run(cmd, output_dir=out, fault=FAULT, retry=True))
    return collect(out)


@pytest.fixture(scope="module")
def fp16_reference(tmp_path_factory):
    return fp16_run(tmp_path_factory.mktemp("fp16_reference") / "run", 1)


def test_the_scale_grows_backs_off_and_the_overflow_step_is_skipped(fp16_reference):
    ref = fp16_reference
    assert [r["loss_scale"] for r in ref.train.values()] == EXPECTED_SCALES
    assert [r["skipped_steps"] for r in ref.train.values()] == EXPECTED_SKIPPED
    losses = ref.losses
    assert losses[3] != losses[3] and all(x == x for i, x in enumerate(losses) if i != 3), losses  # NaN at 4 only
    assert losses[5] < losses[0]  # still training after the skipped step


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_loss_scaling_is_the_same_in_every_layout(layout, fp16_reference, tmp_path):
    size = {"dp2": "data", "tp2": "tensor", "pp2": "pipeline"}[layout]
    got = fp16_run(tmp_path / layout, 2, f"train.dist.{size}_parallel_size=2")
    assert [r["loss_scale"] for r in got.train.values()] == EXPECTED_SCALES
    assert [r["skipped_steps"] for r in got.train.values()] == EXPECTED_SKIPPED
    assert_matches_reference(got, fp16_reference, f"fp16 {layout}", steps=6, precision="fp16")
