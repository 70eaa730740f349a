"""Supervised fine-tuning (llama_sft on the built-in prompt/response pairs, loss on the responses only) trains to
the same numbers in parallel layouts as on one process: the samples carry only ``input_ids`` and
``shift_labels`` (right padding, no attention mask), which is all a pipeline passes. fp32, fixed global batch 8
and micro-batch 2, 5 steps, from the same pretrained llama_debug weights."""

from __future__ import annotations

import pytest

from dufu_testing import train
from parity import Spec, assert_matches_reference

pytestmark = pytest.mark.multiprocess

TP2 = "train.dist.tensor_parallel_size=2"
LAYOUTS = {
    "dp2": ["train.dist.data_parallel_size=2"],
    "tp2-sp": [TP2, "train.dist.sequence_parallel=True"],
    "pp2": ["train.dist.pipeline_parallel_size=2"],
    # context parallelism: chunks of prompt or padding hold no target and add nothing
    "cp2": ["train.dist.context_parallel_size=2"],
}


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory, dufu_cache_dir, reference_run):
    root = tmp_path_factory.mktemp("sft")
    pretrained = root / "pretrained"
    train(pretrained, ["train.train_iter=2", "train.checkpointer.period=2"], recipe="llama_debug")
    args = [f"model.pretrained={pretrained}"]
    return args, reference_run("llama_sft", *args)


@pytest.fixture(scope="module")
def layout_runs(sft_reference, shared_runs):
    """Every layout's run, launched together (tests/parity.py's SharedRuns)."""
    args, _ = sft_reference
    return shared_runs({layout: Spec(2, (*args, *overrides), config="llama_sft") for layout, overrides in LAYOUTS.items()})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_layout_matches_single_process(layout, sft_reference, layout_runs):
    args, reference = sft_reference
    got = layout_runs.result(layout)
    assert_matches_reference(got, reference, f"llama_sft {layout}")


@pytest.mark.parametrize("micro", [1, 8])
def test_sft_loss_is_the_global_token_mean_whatever_the_micro_batch(micro, sft_reference, reference_run):
    """Samples hold different numbers of response tokens, so a mean of micro-batch means would depend on the
    micro-batch size; the trainer weights each micro-batch by its targets, so accumulating 8 x 1 or 1 x 8 is
    the same step as the reference's 4 x 2."""
    args, reference = sft_reference
    got = reference_run("llama_sft", *args, f"train.train_micro_batch_size={micro}")  # one process, in this one
    assert_matches_reference(got, reference, f"llama_sft micro-batch {micro}")
