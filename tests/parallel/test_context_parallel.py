"""Context parallelism's parts: the load-balanced layout, splitting a batch, attention over the gathered keys and
values against one device (several processes), and the start-up refusals with their arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

import launch
from dufu.engine.preflight import preflight
from dufu.errors import LayoutError
from dufu.parallel.context_parallel import ContextParallel
from dufu.parallel.parallel_dims import ParallelDims
from dufu_testing import load_config

CP = "train.dist.context_parallel_size"


def test_each_rank_holds_chunk_r_and_its_mirror():
    """T = 8 over cp 2: chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (balanced causal work)."""
    cps = [ContextParallel(None, 2, r) for r in range(2)]
    assert cps[0].token_index(8).tolist() == [0, 1, 6, 7]
    assert cps[1].token_index(8).tolist() == [2, 3, 4, 5]
    four = [ContextParallel(None, 4, r).token_index(16).tolist() for r in range(4)]
    assert four[0] == [0, 1, 14, 15] and four[3] == [6, 7, 8, 9]
    assert sorted(sum(four, [])) == list(range(16))
    # every rank attends to 2 cp + 1 chunks of keys under a causal mask
    assert {sum(a + 1 for a in ContextParallel(None, 4, r).chunk_ids()) for r in range(4)} == {9}


def test_gather_puts_every_ranks_tokens_back_in_sequence_order():
    T = 16
    x = torch.arange(T).float()[None, :, None]  # (1, T, 1): each token its position
    shards = [x[:, ContextParallel(None, 4, r).token_index(T)] for r in range(4)]
    cp = ContextParallel(None, 4, 1, gather=lambda t, dim: torch.cat(shards, dim))
    assert cp.gather(shards[1], 1).flatten().tolist() == list(range(T))


def test_shard_batch_splits_every_token_tensor_and_adds_global_positions():
    cp = ContextParallel(None, 2, 1)
    ids = torch.arange(16).view(2, 8)
    out = cp.shard_batch({"input_ids": ids, "shift_labels": ids + 100, "attention_mask": torch.ones(2, 8)})
    assert out["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert out["shift_labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5]] * 2 and out["attention_mask"].shape == (2, 4)
    # a model's own positions (RoBERTa counts from pad_token_id + 1) are computed on the whole sequence
    cp.positions = lambda input_ids: torch.arange(input_ids.shape[1])[None] + 2
    assert cp.shard_batch({"input_ids": ids})["position_ids"].tolist() == [[4, 5, 6, 7]] * 2


@pytest.mark.parametrize("inputs, fragment", [
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)},
     "sequence-classification"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": torch.zeros(1, 8, dtype=torch.long)},
     "packing and document_mask off"),
    ({"pixel_values": torch.zeros(2, 3, 8, 8)}, "no (B, T) input_ids"),
])
def test_batches_context_parallelism_cannot_split_are_refused(inputs, fragment):
    with pytest.raises(ValueError, match="context") as info:
        ContextParallel(None, 2, 0).shard_batch(inputs)
    assert fragment in str(info.value)


def test_the_world_is_dp_x_cp_x_tp_x_pp():
    dims = ParallelDims(2, 2, 1, 8, context_parallel_size=2)
    assert dims.data_axis_size == 4 and dims.describe().startswith("dp 2 x cp 2 x tp 2 x pp 1 = 8")
    assert ParallelDims(-1, 1, 1, 8, context_parallel_size=4).data_parallel_size == 2
    with pytest.raises(LayoutError, match=r"dp 1 x cp 2 x tp 1 x pp 1 = 2, but WORLD_SIZE is 4"):
        ParallelDims(1, 1, 1, 4, context_parallel_size=2)
    with pytest.raises(LayoutError, match="not supported together"):
        ParallelDims(2, 1, 1, 4, expert_parallel_size=2, context_parallel_size=2)


# id: (recipe, world size, overrides, fragments of the message)
REFUSALS = {
    "seq-not-divisible": ("gpt_debug", 3, [f"{CP}=3"],
                          ["2 x cp = 6 chunks", "seq_length 32 / 6 = 5.33333 is not whole", "(nearest: 30 or 36)"]),
    "t5": ("t5_debug", 2, [f"{CP}=2"], ["T5ForConditionalGeneration cannot be split by context parallelism",
                                          "cross-attention", "context_parallel_size=1"]),
    "vit": ("vit_debug", 2, [f"{CP}=2"], ["ViTForImageClassification cannot be split", "[CLS]"]),
    "swin": ("swin_debug", 2, [f"{CP}=2"], ["SwinForImageClassification cannot be split", "windows"]),
    "classification": ("bert_classify_debug", 2, [f"{CP}=2"], ["BertForSequenceClassification cannot be split"]),
    "moe": ("moe_debug", 2, [f"{CP}=2"], ["MoEModel cannot be split", "load-balancing loss"]),
    "document-mask": ("llama_debug", 2, [f"{CP}=2", "dataloader.train.document_mask=True"],
                ["packed samples and document masks", "context_parallel_size=1"]),
    "product": ("gpt_debug", 2, [f"{CP}=2", "train.dist.data_parallel_size=2"],
                ["dp 2 x cp 2 x tp 1 x pp 1 = 4", "WORLD_SIZE is 2"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_layouts_context_parallelism_cannot_take_fail_at_preflight(case, tmp_path):
    recipe, world, overrides, fragments = REFUSALS[case]
    cfg = load_config(recipe, [*overrides, f"train.output_dir={tmp_path / 'run'}"])
    with pytest.raises(LayoutError) as info:
        preflight(cfg, world_size=world)
    message = " ".join(str(info.value).split())
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.multiprocess
def test_attention_over_chunks_equals_one_device(tmp_path, nproc=4):
    """Outputs, input gradients and weight gradients of one attention layer: causal, grouped-query, padded,
    bidirectional with a padding mask or a bias (tests/parallel/context_parallel_worker.py)."""
    worker = launch.REPO / "tests" / "parallel" / "context_parallel_worker.py"
    proc = launch.run(launch.torchrun_command(worker, nproc, tmp_path), output_dir=tmp_path, timeout=300)
    launch.assert_ok(proc)
    for rank, worst in enumerate(json.loads((tmp_path / "errors.json").read_text())):
        for case, err in worst.items():
            assert err < 1e-5, f"cp{nproc} rank {rank} {case}: largest error {err}"
