"""The promise: every layout trains to the same numbers as one process.

gpt_debug, fixed global batch 8, 5 steps, evaluated before and after training.

* fp32, every layout: the logged training losses, gradient norms, eval_loss and eval_ppl equal the
  single-process ones within 1e-5 relative, and the weights after the last step match (tests/parity.py derives
  the bound).
* bf16 and fp16 (autocast, fp32 master weights) in dp2, tp2, pp2 and dp2 ZeRO-2 and ZeRO-3 (ZeRO-1 runs ZeRO-2's
  code), each against one process in the same dtype, within the tolerances derived for that arithmetic in
  tests/parity.py (PRECISIONS). fp16 runs with dynamic loss scaling; the scaler's growth and backoff are checked in
  test_loss_scaling.py. Under data parallelism FSDP2's mixed-precision policy gathers the blocks in the compute
  dtype and reduces in fp32 (dufu.parallel.data_parallel.mixed_precision_policy): a hook (precision_probe.py)
  records that the blocks' weights and inputs and the embedding tables are bf16 / fp16 while they run, and the
  sharded parameters and their gradients fp32.
* plain SGD without clipping (tests/parity.py's SGD_ARGS) in one layout per way a gradient gets scaled, where
  a gradient off by a constant factor also changes the weights and the losses.
* the check sees a gradient scale bug: a layout with every gradient x2, or only the replicated parameters'
  (as if tensor parallelism summed their gradients instead of averaging them), fails the comparison at its
  first step, on the gradient norm, under AdamW with clipping as under SGD (where the later losses and the
  weights fail too).
"""

from __future__ import annotations

import pytest

import json

from parity import (EVAL_ARGS, SGD_ARGS, Spec, assert_losses_match, assert_matches_reference,
                    assert_sgd_weights_match, scale_gradients)
from precision_probe import probe_dtypes

pytestmark = pytest.mark.multiprocess

DP2, TP2, PP2 = "train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2"
ZERO = "train.zero_optimization.enabled=True"
SP = "train.dist.sequence_parallel=True"

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
    # every record holds the largest rank's memory high-water mark of its window (dufu.engine.reporting.memory)
    assert all(r["mem_rss_peak_mib"] > 50 for r in got.train.values()), layout


# Mixed precision: 2 processes each; the single-process reference runs in the same dtype.
PRECISION_LAYOUTS = {
    "dp2": [DP2, probe_dtypes()],
    "tp2": [TP2],
    "pp2": [PP2],
    "dp2-zero2": [DP2, ZERO, "train.zero_optimization.stage=2", probe_dtypes()],
    "dp2-zero3": [DP2, ZERO, "train.zero_optimization.stage=3", probe_dtypes()],
}
TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
PROBED = [layout for layout, overrides in PRECISION_LAYOUTS.items() if probe_dtypes() in overrides]


def amp_args(dtype: str) -> tuple[str, ...]:
    """bf16 / fp16 autocast; fp16 from a loss scale of 2**12, 16x under the default: at 2**16 step 3's gradients sit
    at fp16's edge, where a pipeline's micro-batches overflowed and one process did not (the decision is exact, the
    gradients are not). The scaler's overflow and backoff are tested in test_loss_scaling.py."""
    if dtype == "fp16":
        return "train.amp.enabled=True", "train.amp.dtype=fp16", "train.amp.loss_scaler.init_scale=4096"
    return "train.amp.enabled=True", f"train.amp.dtype={dtype}"


# SGD without clipping on 2 processes, one layout per place that scales gradients: data-parallel averaging over 4
# accumulated micro-batches per rank (one process accumulates 4 of twice the size), ZeRO-3's reduce-scatter, the
# reduction of the replicated norms' gradients over tensor-parallel ranks under SP, a pipeline schedule's loss
# scaling. (The compositions on 4 and 8 processes are held to the same gradient norms under AdamW above.)
SGD_LAYOUTS = {
    "dp2-accumulate": [DP2, "train.train_micro_batch_size=1"],
    "dp2-zero3": [DP2, ZERO, "train.zero_optimization.stage=3"],
    "tp2-sp": [TP2, SP],
    "pp2-1f1b": [PP2, "train.dist.pipeline_schedule=1f1b"],
}

# A gradient scale bug on purpose (tests/parity.py's ScaleGradients, after the backward), on 2 processes. id:
# (optimizer overrides: none for the recipe's AdamW clipped at 1.0, layout overrides). "replicated": the norms'
# (and position embeddings', row-parallel biases') gradients only, as if SP's reduction summed them over the
# tensor-parallel ranks instead of averaging.
SCALE_BUGS = {
    "x2-dp2": ((), [DP2, scale_gradients(2.0)]),
    "x2-dp2-sgd": (SGD_ARGS, [DP2, scale_gradients(2.0)]),
    "x2-replicated-tp2-sp": ((), [TP2, SP, scale_gradients(2.0, "replicated")]),
}


def bug_reference(parity_reference, optim_args: tuple):
    """The clean run a scale bug's run is compared with: SGD's, or AdamW's with evaluation (the grid's)."""
    return parity_reference(2, *optim_args) if optim_args else parity_reference(2, *EVAL_ARGS)


# Every layout's run, launched together by world size (tests/parity.py's SharedRuns): fp32 runs by layout id,
# mixed-precision runs as "<dtype>-<layout>", SGD runs as "sgd-<layout>", scale bugs as "bug-<id>".
RUNS = {
    **{layout: Spec(nproc, (f"model.num_layers={layers}", *EVAL_ARGS, *overrides))
       for layout, (nproc, layers, overrides) in LAYOUTS.items()},
    **{f"{dtype}-{layout}": Spec(2, (*amp_args(dtype), *overrides))
       for dtype in ("bf16", "fp16") for layout, overrides in PRECISION_LAYOUTS.items()},
    **{f"sgd-{layout}": Spec(2, ("model.num_layers=2", *SGD_ARGS, *overrides))
       for layout, overrides in SGD_LAYOUTS.items()},
    **{f"bug-{bug}": Spec(2, ("model.num_layers=2", *(optim_args or EVAL_ARGS), *overrides))
       for bug, (optim_args, overrides) in SCALE_BUGS.items()},
}


@pytest.fixture(scope="module")
def layout_runs(shared_runs):
    return shared_runs(RUNS, uses={
        "test_mixed_precision_layout_matches_single_process": lambda p: f"{p['dtype']}-{p['layout']}",
        "test_data_parallel_gathers_blocks_in_the_compute_dtype": lambda p: f"{p['dtype']}-{p['layout']}",
        "test_sgd_layout_matches_single_process": lambda p: f"sgd-{p['layout']}",
        "test_parity_check_fails_on_a_gradient_scale_bug": lambda p: f"bug-{p['bug']}"})


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


@pytest.mark.parametrize("layout", PROBED)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_data_parallel_gathers_blocks_in_the_compute_dtype(dtype, layout, layout_runs):
    """FSDP2's policy (replicate's too): every block's weights and its input are in the compute dtype while it
    runs, gathered (plain tensors, not the sharded DTensors), and so are the embedding tables; the sharded
    parameters the optimizer updates and their gradients are fp32."""
    out = layout_runs.output_dir(f"{dtype}-{layout}")
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("dtypes-rank*.json"))]
    assert len(ranks) == 2, f"{layout}: {sorted(p.name for p in out.iterdir())}"
    for seen in ranks:
        blocks = {k: v for k, v in seen["forward"].items() if not k.startswith("embedding")}
        embeddings = {k: v for k, v in seen["forward"].items() if k.startswith("embedding")}
        assert len(blocks) == 2 and embeddings, seen["forward"]  # gpt_debug: 2 blocks, wte and wpe
        for name, rec in blocks.items():
            assert rec == {"weight": TORCH_NAMES[dtype], "gathered": True, "input": TORCH_NAMES[dtype]}, (name, rec)
        for name, rec in embeddings.items():
            assert rec["weight"] == TORCH_NAMES[dtype] and rec["gathered"], (name, rec)
        assert seen["sharded"]["params"] == seen["sharded"]["grads"] == ["float32"], seen["sharded"]
        if layout != "dp2":
            assert seen["sharded"]["dtensors"], seen["sharded"]


@pytest.mark.parametrize("layout", list(SGD_LAYOUTS))
def test_sgd_layout_matches_single_process(layout, parity_reference, layout_runs):
    reference = parity_reference(2, *SGD_ARGS)
    got = layout_runs.result(f"sgd-{layout}")
    assert got.optimizer == reference.optimizer == "SGD"
    assert_matches_reference(got, reference, f"SGD {layout}")


@pytest.mark.parametrize("bug", list(SCALE_BUGS))
def test_parity_check_fails_on_a_gradient_scale_bug(bug, parity_reference, layout_runs):
    """The doubled gradient is in the logged norm, and assert_matches_reference stops at it, at step 1. AdamW with
    clipping hides every gradient x2 from the losses and weights (the same losses, weights within the bound); SGD
    does not: there the later losses and the weights fail on their own."""
    optim_args, _ = SCALE_BUGS[bug]
    reference = bug_reference(parity_reference, optim_args)
    got = layout_runs.result(f"bug-{bug}")
    norm, ref_norm = got.train[1]["grad_norm"], reference.train[1]["grad_norm"]
    if bug.startswith("x2-replicated"):  # a part of the gradient doubled: the norm grows, by less than 2x
        assert ref_norm * (1 + 1e-4) < norm < 2 * ref_norm, (norm, ref_norm)
    else:
        assert norm == pytest.approx(2 * ref_norm, rel=1e-5)
    with pytest.raises(AssertionError, match=r"step 1 grad_norm .* != single-process"):
        assert_matches_reference(got, reference, bug)
    if optim_args:  # under SGD the losses after the first update, and the weights, fail without the norms
        losses = {s: r["loss"] for s, r in reference.train.items()}
        with pytest.raises(AssertionError, match=r"loss .* != reference"):
            assert_losses_match(got.output_dir, losses, steps=range(2, 6))
        with pytest.raises(AssertionError, match="SGD's roundoff bound"):
            assert_sgd_weights_match(got.state, reference.state, bug, reference.lrs, reference.grad_norms,
                                     reference.optim)
