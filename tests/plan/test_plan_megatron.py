"""The planner on Megatron-LM's published GPT layouts on A100-80GB (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", Table 1): they fit, and the search's choice of tensor and
pipeline sizes against Megatron's.

Each row is planned as a dufu GPT config (vocabulary 51,200, sequence 2,048, bf16, full activation recomputation)
with the paper's tensor/pipeline sizes and global batch, the micro-batch left to the planner. How close the
predicted throughput comes to the published one is checked on rows the GPU constants were not fitted to, in
tests/plan/test_plan_heldout.py (the rows, their sources and the fit: benchmarks/plan_fit.py).
"""

from __future__ import annotations

import pytest

from plan_testing import load
from dufu.plan import estimate, search

# params (B), heads, hidden, layers, TP, PP, GPUs, batch, published TFLOP/s per GPU
ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
]
SEQ, VOCAB = 2048, 51200


def megatron_config(row, search_tp_pp: bool = False):
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    dist = (["train.dist.tensor_parallel_size=auto", "train.dist.pipeline_parallel_size=auto",
             "train.dist.data_parallel_size=auto"] if search_tp_pp else
            [f"train.dist.tensor_parallel_size={tp}", f"train.dist.pipeline_parallel_size={pp}",
             f"train.dist.data_parallel_size={gpus // (tp * pp)}"])
    return load("gpt2_small", f"model.vocab_size={VOCAB}", f"model.hidden_size={hidden}",
                f"model.num_attention_heads={heads}", f"model.num_layers={layers}",
                f"model.max_position_embeddings={SEQ}", f"dataloader.train.seq_length={SEQ}",
                f"train.global_batch_size={batch}", "train.train_micro_batch_size=auto",
                "train.activation_checkpoint.enabled=True", "train.activation_checkpoint.mode=full", *dist)


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}B" for r in ROWS])
def test_published_layout_fits_in_80_gb(row):
    plan = search(megatron_config(row), row[6], "a100-80gb")
    best = plan.best
    assert best is not None, plan[0].reason
    assert (best.layout["tensor_parallel_size"], best.layout["pipeline_parallel_size"]) == (row[4], row[5])
    assert best.memory_per_gpu_bytes < 80e9


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}B" for r in ROWS])
def test_choosing_tp_and_pp(row):
    """With TP and PP auto, the layout picked is predicted at least as fast as Megatron's and is within one step of
    it (same TP, PP within a factor of 2), or the plan says why Megatron's is slower."""
    plan = search(megatron_config(row, search_tp_pp=True), row[6], "a100-80gb")
    best = plan.best
    megatron = next(e for e in plan if (e.layout["tensor_parallel_size"], e.layout["pipeline_parallel_size"])
                    == (row[4], row[5]) and e.fits)
    assert best.tokens_per_s >= megatron.tokens_per_s
    tp, pp = best.layout["tensor_parallel_size"], best.layout["pipeline_parallel_size"]
    near = tp == row[4] and max(pp, row[5]) <= 2 * min(pp, row[5])
    if not near:
        # the note names the parts of the step time that make Megatron's layout slower here
        assert megatron.reason.startswith("slower: ") and " vs " in megatron.reason, megatron.reason


def test_estimate_is_the_configs_layout():
    row = ROWS[4]
    cfg = megatron_config(row)
    cfg.train.train_micro_batch_size = 2
    est = estimate(cfg, row[6], "a100-80gb")
    lay = est.layout
    assert (lay["data_parallel_size"], lay["tensor_parallel_size"], lay["pipeline_parallel_size"]) == (32, 8, 2)
    assert (lay["micro_batch_size"], lay["num_accumulation_steps"], lay["zero_stage"]) == (2, 24, 0)
    assert lay["activation_checkpoint"] == "full" and lay["sequence_parallel"] is False
    assert est.dtype == "bf16"  # amp auto on an A100
    assert set(est.memory) == {"parameters", "gradients", "optimizer", "activations", "communication",
                               "pipeline_in_flight", "temporaries"}
    assert sum(est.memory.values()) == est.memory_per_gpu_bytes
    # every rank holds 1/(tp pp) of 39.1B parameters in fp32 (the first stage also the embedding): 16 B each
    share = 39.1e9 / 16
    assert 0.95 * 4 * share < est.memory["parameters"] < 1.1 * 4 * share
    assert est.memory["optimizer"] == 2 * est.memory["parameters"]
    # the step: 24 micro-batches through 2 stages (1F1B): the bubble is one slot of 25
    slot = (est.time["compute"] + est.time["tp_comm"]) / 24
    assert est.time["bubble"] == pytest.approx(slot, rel=0.05)
    assert est.step_time_s == pytest.approx(sum(v for k, v in est.time.items() if k != "dp_comm"))
