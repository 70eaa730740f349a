"""Context parallelism trains to the numbers of one process (fp32, fixed global batch 8, 5 steps: losses within
1e-5 relative and the final weights), alone and composed with data parallelism, ZeRO-3, tensor + sequence
parallelism and pipelines, on a causal decoder with rotary positions and grouped-query attention (llama_debug), a
bidirectional encoder with learned positions (bert_debug, masked LM) and GPT-2's learned positions (gpt_debug, as
the README's command runs it). A checkpoint saved at cp2 resumes at cp4 and on one process with the uninterrupted
losses. Supervised fine-tuning whose targets are the responses only (many chunks hold no target at all) runs at
cp2 in test_sft_layouts.py.
"""

from __future__ import annotations

import shutil

import pytest

import launch
from dufu.cli import main as cli_main
from parity import EVAL_ARGS, Spec, assert_losses_match, assert_matches_reference

pytestmark = pytest.mark.multiprocess

CP2, CP4 = "train.dist.context_parallel_size=2", "train.dist.context_parallel_size=4"
DP2, TP2, PP2 = ("train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2",
                 "train.dist.pipeline_parallel_size=2")
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")
SP = "train.dist.sequence_parallel=True"
# id: (recipe, processes, overrides). Each composition once, on the family where it differs most: rotary positions
# and grouped-query heads (llama_debug) with ZeRO-3, TP + SP, pipelines and cp4; the bidirectional encoder with
# learned positions and post-norm blocks (bert_debug) with plain data parallelism (DDP) and TP + SP; cp2 alone
# runs in the GPT, SFT and resume tests below.
LAYOUTS = {
    "llama-cp4": ("llama_debug", 4, [CP4]),
    "llama-dp2-cp2-zero3": ("llama_debug", 4, [DP2, CP2, *ZERO3]),
    "llama-cp2-tp2-sp": ("llama_debug", 4, [CP2, TP2, SP]),
    "llama-cp2-pp2": ("llama_debug", 4, [CP2, PP2]),
    # selective checkpointing keeps the K/V all-gather's output and replays the forward without communicating
    "llama-cp2-selective-checkpointing": ("llama_debug", 2, [CP2, "train.activation_checkpoint.enabled=True",
                                                             "train.activation_checkpoint.mode=selective"]),
    "bert-dp2-cp2": ("bert_debug", 4, [DP2, CP2]),
    "bert-cp2-tp2-sp": ("bert_debug", 4, [CP2, TP2, SP]),
}


# Every run of this module, launched together by world size (tests/parity.py's SharedRuns).
RUNS = {
    **{layout: Spec(nproc, tuple(overrides), config=recipe) for layout, (recipe, nproc, overrides) in LAYOUTS.items()},
    "gpt-cp2": Spec(2, (CP2, "model.num_layers=2", *EVAL_ARGS)),
    "llama-cp2-stopped-at-3": Spec(2, (CP2, "train.stop_at_iter=3", "train.checkpointer.period=3"), config="llama_debug"),
}
USES = {"test_gpt_debug_at_cp2_gives_the_losses_of_one_process": "gpt-cp2",
        "test_a_cp2_checkpoint_resumes_at_cp4_and_on_one_process": "llama-cp2-stopped-at-3"}


@pytest.fixture(scope="module")
def cp_runs(shared_runs):
    return shared_runs(RUNS, uses=USES)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_single_process(layout, recipe_reference, cp_runs):
    recipe = LAYOUTS[layout][0]
    got = cp_runs.result(layout)
    assert_matches_reference(got, recipe_reference(recipe), layout)


def test_gpt_debug_at_cp2_gives_the_losses_of_one_process(parity_reference, cp_runs):
    """``dufu train gpt_debug --nproc 2 train.dist.context_parallel_size=2`` (learned absolute positions), with
    validation before and after training (evaluation splits its batches the same way)."""
    got = cp_runs.result("gpt-cp2")
    assert_matches_reference(got, parity_reference(2, *EVAL_ARGS), "gpt_debug cp2")


def test_a_cp2_checkpoint_resumes_at_cp4_and_on_one_process(recipe_reference, cp_runs, tmp_path):
    reference = recipe_reference("llama_debug")
    first = cp_runs.output_dir("llama-cp2-stopped-at-3")
    for name, nproc, cp in [("cp4", 4, CP4), ("one", 1, "train.dist.context_parallel_size=1")]:
        out = tmp_path / name
        shutil.copytree(first, out)
        if nproc == 1:  # in this process, as `dufu train` runs one
            assert cli_main(["train", str(out / "config.yaml"), "--resume", f"train.output_dir={out}", cp]) == 0
        else:
            proc = launch.run(launch.train_command(out / "config.yaml", out, nproc, cp, resume=True),
                              output_dir=out, timeout=600)
            launch.assert_ok(proc)
        assert_losses_match(out, reference, steps=[4, 5])  # and the gradient norms
