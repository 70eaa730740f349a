"""Context parallelism trains to the numbers of one process (fp32, fixed global batch 8, 5 steps: losses within
1e-5 relative and the final weights), alone and composed with data parallelism, ZeRO-3, tensor + sequence
parallelism and pipelines, on a causal decoder with rotary positions and grouped-query attention (llama_debug), a
bidirectional encoder with learned positions (bert_debug, masked LM) and GPT-2's learned positions (gpt_debug, as
the README's command runs it); in each of its modes: the all-gather of K/V, Ulysses' all-to-all of heads (cp2,
cp4 with fewer key/value heads than ranks, under tensor parallelism) and the hierarchical mix (cp 2 x 2). A
checkpoint saved at cp2 resumes at cp4 and on one process with the uninterrupted losses. Supervised fine-tuning
whose targets are the responses only (many chunks hold no target at all) runs at cp2 in test_sft_layouts.py.

Hybrid sharding (HSDP: ZeRO over replicas of data-parallel shards, which shard over dp x cp) runs here too, in this
module's 4-process job: dp 2 x 2 under ZeRO-3, and replicas across dp of shards across cp under ZeRO-2.
"""

from __future__ import annotations

import shutil

import pytest
from torch.distributed.checkpoint import FileSystemReader

import launch
from dufu.cli import main as cli_main
from parity import EVAL_ARGS, Spec, assert_losses_match, assert_matches_reference

pytestmark = pytest.mark.multiprocess

CP2, CP4 = "train.dist.context_parallel_size=2", "train.dist.context_parallel_size=4"
DP2, TP2, PP2 = ("train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2",
                 "train.dist.pipeline_parallel_size=2")
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")
SP = "train.dist.sequence_parallel=True"
ULYSSES = "train.dist.context_parallel_mode=all_to_all"
HIERARCHICAL = ("train.dist.context_parallel_mode=hierarchical", "train.dist.context_parallel_a2a_size=2")
REPLICAS2 = "train.dist.data_parallel_replicate_size=2"
ZERO2 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=2")
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
    # Ulysses: 2 key/value heads over 4 ranks (repeated to 4); the bidirectional encoder's heads split by tp, then cp
    "llama-cp4-ulysses": ("llama_debug", 4, [CP4, ULYSSES]),
    "bert-cp2-tp2-sp-ulysses": ("bert_debug", 4, [CP2, TP2, SP, ULYSSES]),
    # all-to-all inside cp ranks [0,1] and [2,3], all-gather of K/V across them
    "llama-cp2x2-hierarchical": ("llama_debug", 4, [CP4, *HIERARCHICAL]),
    # HSDP under ZeRO-2 with cp: dp 2 x cp 2 as 2 replicas (across dp) of the cp pair's shards
    "llama-dp2-cp2-hsdp-zero2": ("llama_debug", 4, [DP2, CP2, REPLICAS2, *ZERO2]),
}


# Every run of this module, launched together by world size (tests/parity.py's SharedRuns).
RUNS = {
    **{layout: Spec(nproc, tuple(overrides), config=recipe) for layout, (recipe, nproc, overrides) in LAYOUTS.items()},
    "gpt-cp2": Spec(2, (CP2, "model.num_layers=2", *EVAL_ARGS)),
    "gpt-cp2-ulysses": Spec(2, (CP2, ULYSSES, "model.num_layers=2", *EVAL_ARGS)),
    "gpt-dp2x2-hsdp-zero3": Spec(4, (REPLICAS2, *ZERO3, "model.num_layers=2", *EVAL_ARGS)),
    "llama-cp2-stopped-at-3": Spec(2, (CP2, "train.stop_at_iter=3", "train.checkpointer.period=3"), config="llama_debug"),
}
USES = {"test_gpt_debug_at_cp2_gives_the_losses_of_one_process": lambda params: params["run"],
        "test_a_cp2_checkpoint_resumes_at_cp4_and_on_one_process": "llama-cp2-stopped-at-3",
        "test_hybrid_sharding_dp_2x2_gives_the_numbers_of_one_process": "gpt-dp2x2-hsdp-zero3"}


@pytest.fixture(scope="module")
def cp_runs(shared_runs):
    return shared_runs(RUNS, uses=USES)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_single_process(layout, recipe_reference, cp_runs):
    recipe = LAYOUTS[layout][0]
    got = cp_runs.result(layout)
    assert_matches_reference(got, recipe_reference(recipe), layout)


@pytest.mark.parametrize("run", ["gpt-cp2", "gpt-cp2-ulysses"])
def test_gpt_debug_at_cp2_gives_the_losses_of_one_process(run, parity_reference, cp_runs):
    """``dufu train gpt_debug --nproc 2 train.dist.context_parallel_size=2`` (learned absolute positions), with
    validation before and after training (evaluation splits its batches the same way); all-gather and Ulysses."""
    got = cp_runs.result(run)
    assert_matches_reference(got, parity_reference(2, *EVAL_ARGS), f"gpt_debug {run}")


def test_hybrid_sharding_dp_2x2_gives_the_numbers_of_one_process(parity_reference, cp_runs):
    """dp 4 under ZeRO-3 as 2 replicas of 2 shards (FSDP2 on the ("dp_replicate", "dp_shard") mesh): gradients
    reduce-scattered within a replica and all-reduced across the two, averaged over all four ranks as without
    hybrid sharding (the gradient norms would show a sum), and the checkpoint gathers to the same weights."""
    got = cp_runs.result("gpt-dp2x2-hsdp-zero3")
    assert_matches_reference(got, parity_reference(2, *EVAL_ARGS), "gpt_debug dp 2x2 HSDP ZeRO-3")
    # sharded 2 ways (within a replica), not 4: the checkpoint holds each weight as 2 shards, saved once
    ckpt = sorted((got.output_dir / "checkpoints").glob("step_*"))[-1]
    metadata = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    shards = {len(m.chunks) for name, m in metadata.items() if name.startswith("model.") and len(m.size) == 2}
    assert shards == {2}, f"weights stored in {shards} shards"


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
