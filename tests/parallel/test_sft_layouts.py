"""Supervised fine-tuning (llama_sft on the built-in prompt/response pairs, loss on the responses only) trains to
the same numbers in parallel layouts as on one process: the samples carry only ``input_ids`` and
``shift_labels`` (right padding, no attention mask), which is all a pipeline passes. fp32, fixed global batch 8
and micro-batch 2, 5 steps, from the same pretrained llama_debug weights."""

from __future__ import annotations

import pytest

from dufu_testing import train
from parallel_runs import PARITY_ARGS, assert_matches_reference, assert_ok, final_model_state, losses, run_dufu

TP2 = "train.dist.tensor_parallel_size=2"
LAYOUTS = {
    "dp2": ["train.dist.data_parallel_size=2"],
    "tp2-sp": [TP2, "train.dist.sequence_parallel=True"],
    "pp2": ["train.dist.pipeline_parallel_size=2"],
}


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory, dufu_cache_dir):
    root = tmp_path_factory.mktemp("sft")
    pretrained = root / "pretrained"
    train(pretrained, ["train.train_iter=2", "train.checkpointer.period=2"], recipe="llama_debug")
    args = [*PARITY_ARGS, f"model.pretrained={pretrained}"]
    out = root / "reference"
    assert_ok(run_dufu(out, 1, *args, config="llama_sft"))
    return args, losses(out), final_model_state(out)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_layout_matches_single_process(layout, sft_reference, tmp_path):
    args, ref_losses, ref_state = sft_reference
    out = tmp_path / layout
    assert_ok(run_dufu(out, 2, *args, *LAYOUTS[layout], config="llama_sft"))
    assert_matches_reference(out, (ref_losses, ref_state), f"llama_sft {layout}")


@pytest.mark.parametrize("micro", [1, 8])
def test_sft_loss_is_the_global_token_mean_whatever_the_micro_batch(micro, sft_reference, tmp_path):
    """Samples hold different numbers of response tokens, so a mean of micro-batch means would depend on the
    micro-batch size; the trainer weights each micro-batch by its targets, so accumulating 8 x 1 or 1 x 8 is
    the same step as the reference's 4 x 2."""
    args, ref_losses, ref_state = sft_reference
    out = tmp_path / f"micro{micro}"
    assert_ok(run_dufu(out, 1, *args, f"train.train_micro_batch_size={micro}", config="llama_sft"))
    assert_matches_reference(out, (ref_losses, ref_state), f"llama_sft micro-batch {micro}")
