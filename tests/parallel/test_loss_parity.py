"""The promise: every layout trains to the same numbers as one process.

gpt_debug, fixed global batch 8, 5 steps, evaluated before and after training.

* fp32, every layout: the logged training losses, eval_loss and eval_ppl equal the single-process ones within
  1e-5 relative, and the weights after the last step match (tests/parity.py derives the bound).
* bf16 and fp16 (autocast, fp32 master weights) in dp2, tp2, pp2 and dp2 ZeRO-3, each against one process in
  the same dtype, within the tolerances derived for that arithmetic in tests/parity.py (PRECISIONS). fp16 runs
  with dynamic loss scaling; the scaler's growth and backoff are checked in test_loss_scaling.py.
"""

from __future__ import annotations

import pytest

from parity import EVAL_ARGS, Spec, assert_matches_reference

pytestmark = pytest.mark.multiprocess

DP2, TP2, PP2 = "train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2"
ZERO = "train.zero_optimization.enabled=True"

# id: (processes, model layers, overrides)
LAYOUTS = {
    "dp2": (2, 2, [DP2]),
    "dp2-zero1": (2, 2, [DP2, ZERO, "train.zero_optimization.stage=1"]),
    "dp2-zero2": (2, 2, [DP2, ZERO, "train.zero_optimization.stage=2"]),
    "dp2-zero3": (2, 2, [DP2, ZERO, "train.zero_optimization.stage=3"]),
    "dp4-zero3": (4, 2, ["train.dist.data_parallel_size=4", ZERO, "train.zero_optimization.stage=3"]),
    "tp2": (2, 2, [TP2]),
    "tp2-sp": (2, 2, [TP2, "train.dist.sequence_parallel=True"]),
    "pp2-gpipe": (2, 2, [PP2, "train.dist.pipeline_schedule=gpipe"]),
    "pp2-1f1b": (2, 2, [PP2, "train.dist.pipeline_schedule=1f1b"]),
    "pp2-interleaved": (2, 4, [PP2, "train.dist.pipeline_schedule=interleaved_1f1b", "train.dist.virtual_pipeline_size=2"]),
    "pp2-zero-bubble": (2, 4, [PP2, "train.dist.pipeline_schedule=interleaved_zero_bubble", "train.dist.virtual_pipeline_size=2"]),
    "dp2xtp2": (4, 2, [DP2, TP2]),
    "dp2xpp2": (4, 2, [DP2, PP2]),
    "tp2xpp2": (4, 2, [TP2, PP2]),
    "dp2xtp2xpp2": (8, 2, [DP2, TP2, PP2]),
    "dp2xtp2xpp2-ac-zero3": (8, 2, [DP2, TP2, PP2, "train.activation_checkpoint.enabled=True", ZERO,
                                    "train.zero_optimization.stage=3"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, parity_reference, layout_runs):
    layers = LAYOUTS[layout][1]
    reference = parity_reference(layers, *EVAL_ARGS)
    got = layout_runs.result(layout)
    assert sorted(got.evals) == [0, 5], f"{layout}: evaluations at steps {sorted(got.evals)}"
    assert_matches_reference(got, reference, layout)


# Mixed precision: 2 processes each; the single-process reference runs in the same dtype.
PRECISION_LAYOUTS = {
    "dp2": [DP2],
    "tp2": [TP2],
    "pp2": [PP2],
    "dp2-zero3": [DP2, ZERO, "train.zero_optimization.stage=3"],
}


def amp_args(dtype: str) -> tuple[str, str]:
    return "train.amp.enabled=True", f"train.amp.dtype={dtype}"


# Every layout's run, launched together by world size (tests/parity.py's SharedRuns): fp32 runs by layout id,
# mixed-precision runs as "<dtype>-<layout>".
RUNS = {
    **{layout: Spec(nproc, (f"model.num_layers={layers}", *EVAL_ARGS, *overrides))
       for layout, (nproc, layers, overrides) in LAYOUTS.items()},
    **{f"{dtype}-{layout}": Spec(2, (*amp_args(dtype), *overrides))
       for dtype in ("bf16", "fp16") for layout, overrides in PRECISION_LAYOUTS.items()},
}


@pytest.fixture(scope="module")
def layout_runs(shared_runs):
    return shared_runs(RUNS, uses={"test_mixed_precision_layout_matches_single_process":
                                   lambda p: f"{p['dtype']}-{p['layout']}"})


@pytest.mark.parametrize("layout", list(PRECISION_LAYOUTS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_layout_matches_single_process(dtype, layout, parity_reference, layout_runs):
    amp = amp_args(dtype)
    reference = parity_reference(2, *amp)
    got = layout_runs.result(f"{dtype}-{layout}")
    if dtype == "fp16":  # dynamic loss scaling ran, and took the same decisions as one process
        assert [r["loss_scale"] for r in got.train.values()] == [r["loss_scale"] for r in reference.train.values()]
        assert [r["skipped_steps"] for r in got.train.values()] == [r["skipped_steps"] for r in reference.train.values()]
    assert_matches_reference(got, reference, f"{dtype} {layout}", precision=dtype)
