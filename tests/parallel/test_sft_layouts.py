"""Supervised fine-tuning (llama_sft on the built-in prompt/response pairs, loss on the responses only) trains to
the same numbers in parallel layouts as on one process: the samples carry only ``input_ids`` and
``shift_labels`` (right padding, no attention mask), which is all a pipeline passes. fp32, fixed global batch 8
and micro-batch 2, 5 steps, from the same pretrained llama_debug weights."""

from __future__ import annotations

import pytest
import torch

from dufu_testing import train
from parallel_runs import PARITY_ARGS, assert_ok, final_model_state, losses, run_dufu

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
    got = losses(out)
    assert len(got) == len(ref_losses) == 5
    for step, (a, b) in enumerate(zip(got, ref_losses), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"llama_sft {layout}: step {step} loss {a} != single-process {b}"
    state = final_model_state(out)
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{layout}: {name}: {m}")
