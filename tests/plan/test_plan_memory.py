"""Per-rank peak memory: dufu's mechanisms (dufu/parallel/data_parallel.py, pipeline.py, activation_checkpoint.py)
against measurements of the same model and layouts, and the relations those mechanisms imply."""

from __future__ import annotations

import pytest

from plan_testing import GPT30M, load
from dufu.plan import estimate
from dufu.plan.layout import Layout
from dufu.plan.memory import in_flight

MiB = 1024**2

# Measured on this project's CPU runs (benchmarks/results/parallel-2026-11-25.md, the table "glibc malloc with
# MALLOC_MMAP_THRESHOLD_=65536", column "train - baseline"): the GPT above, 2 steps of micro-batch 1 x 64 tokens,
# fp32, AdamW; MiB per rank, the largest rank.
MEASURED = {
    (1, 0): 472, (2, None): 510, (2, 1): 333, (2, 2): 337, (2, 3): 281,
    (4, None): 511, (4, 1): 254, (4, 2): 254, (4, 3): 171,
}


def gpt30m(*overrides):
    return load("gpt_debug", *GPT30M, "train.train_micro_batch_size=1", *overrides)


@pytest.mark.parametrize("dp, stage", list(MEASURED), ids=[f"dp{d}-zero{s}" for d, s in MEASURED])
def test_peak_matches_measured_runs_within_10_percent(dp, stage, test_cpu):
    overrides = [f"train.dist.data_parallel_size={dp}"]
    if stage:
        overrides += ["train.zero_optimization.enabled=True", f"train.zero_optimization.stage={stage}"]
    est = estimate(gpt30m(*overrides), dp, test_cpu)
    predicted = est.memory_per_gpu_bytes / MiB
    assert abs(predicted - MEASURED[(dp, stage)]) <= 0.10 * MEASURED[(dp, stage)], est.memory


# benchmarks/results/parallel-2026-11-22.md, "train - baseline, meta": tensor parallelism over 2 ranks, and two
# 1F1B pipeline stages with 2 micro-batches of 1 (the first stage, which holds more).
@pytest.mark.parametrize("world, overrides, measured", [
    (2, ["train.dist.tensor_parallel_size=2"], 260),
    (2, ["train.dist.pipeline_parallel_size=2", "train.num_accumulation_steps=2"], 286),
], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_peaks_match_measured_runs_within_10_percent(world, overrides, measured, test_cpu):
    predicted = estimate(gpt30m(*overrides), world, test_cpu).memory_per_gpu_bytes / MiB
    assert abs(predicted - measured) <= 0.10 * measured


def test_model_states_follow_the_mechanisms(test_cpu):
    params = 29_447_168 * 4
    one = estimate(gpt30m(), 1, test_cpu).memory
    assert one["parameters"] == pytest.approx(params, rel=1e-6)
    assert one["optimizer"] == pytest.approx(2 * params, rel=1e-6)  # AdamW's two fp32 moments
    z = {s: estimate(gpt30m("train.dist.data_parallel_size=4", "train.zero_optimization.enabled=True",
                            f"train.zero_optimization.stage={s}"), 4, test_cpu) for s in (1, 2, 3)}
    # dufu runs stage 1 with stage-2 sharding: the same memory, and a note saying so
    assert z[1].memory == z[2].memory and any("stage-2 sharding" in n for n in z[1].notes)
    assert z[2].memory["optimizer"] == pytest.approx(2 * params / 4, rel=1e-6)
    # ZeRO-3 also shards the parameters (plus the output unit's sharded copy of the tied embedding: 4/dp B each)
    assert z[3].memory["parameters"] == pytest.approx((params + 8192 * 512 * 4) / 4, rel=1e-6)
    assert z[3].memory_per_gpu_bytes < z[2].memory_per_gpu_bytes
    # stages 1-2 keep every block gathered from its forward to its backward: that is their communication buffer
    assert z[2].memory["communication"] > 0.75 * params


def test_tensor_parallelism_and_activation_checkpointing(test_cpu):
    base = ["train.train_micro_batch_size=16"]
    one = estimate(gpt30m(*base), 1, test_cpu)
    tp2 = estimate(gpt30m(*base, "train.dist.tensor_parallel_size=2"), 2, test_cpu)
    assert tp2.memory["parameters"] == pytest.approx(one.memory["parameters"] / 2, rel=0.01)  # norms replicated
    sp = estimate(gpt30m(*base, "train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"), 2,
                  test_cpu)
    assert sp.memory["activations"] <= tp2.memory["activations"]
    sel = estimate(gpt30m(*base, "train.activation_checkpoint.enabled=True"), 1, test_cpu)
    full = estimate(gpt30m(*base, "train.activation_checkpoint.enabled=True",
                           "train.activation_checkpoint.mode=full"), 1, test_cpu)
    # kept for backward: none > selective (matmul outputs kept) > full (each block's input only)
    assert one.memory["activations"] > sel.memory["activations"] > full.memory["activations"] > 0
    # recomputation costs time: full reruns each block's forward
    assert full.time["compute"] > sel.time["compute"] > one.time["compute"]


def test_bf16_keeps_fp32_master_weights_and_adds_weight_copies(test_cpu):
    fp32 = estimate(gpt30m("train.train_micro_batch_size=16"), 1, test_cpu)
    bf16 = estimate(gpt30m("train.train_micro_batch_size=16", "train.amp.enabled=bf16"), 1, test_cpu)
    assert bf16.dtype == "bf16" and bf16.memory["parameters"] == fp32.memory["parameters"]
    # at the peak (the start of the backward) the matmuls keep autocast's bf16 copy of every block's matrices
    assert bf16.memory["temporaries"] - fp32.memory["temporaries"] >= 2 * 8 * 12 * 512**2
    assert bf16.memory["activations"] < fp32.memory["activations"]  # bf16 matmul outputs


def test_pipeline_ranks_hold_their_schedules_in_flight_micro_batches(test_cpu):
    def layout(schedule, v, m, pp=4):
        return Layout(1, 1, pp, False, v, schedule, 1, m, m, 0, False)

    assert [in_flight(layout("1f1b", 1, 8), r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight(layout("1f1b", 1, 2), 0) == 2  # never more than there are micro-batches
    assert in_flight(layout("gpipe", 1, 8), 3) == 8
    # torch's interleaved 1F1B warm-up: (v - 1) pp + 2 (pp - 1 - r) chunks, plus one, of 1/v of the layers
    assert in_flight(layout("interleaved_1f1b", 2, 8), 0) == (4 + 6 + 1) / 2
    pp2 = estimate(gpt30m("train.dist.pipeline_parallel_size=2", "train.num_accumulation_steps=4"), 2, test_cpu)
    assert pp2.memory_by_rank[0] > pp2.memory_by_rank[1] * 0.9 and pp2.memory["pipeline_in_flight"] > 0
    inter = estimate(gpt30m("train.dist.pipeline_parallel_size=2", "train.num_accumulation_steps=4",
                            "train.dist.pipeline_schedule=interleaved_1f1b", "train.dist.virtual_pipeline_size=2"),
                     2, test_cpu)
    assert inter.time["bubble"] < pp2.time["bubble"]  # (pp - 1) / v slots instead of pp - 1


# benchmarks/results/plan-accuracy-2026-11-25.md: the same GPT, global batch 4 of micro-batch 1 (accumulation 4 / dp),
# 6 steps, no compile; peak RSS minus a tiny-model baseline per rank, the largest rank, in MiB.
PLAN_ACCURACY = [
    ("1 process", 1, [], 502),
    ("1 process, bf16", 1, ["train.amp.enabled=bf16"], 592),
    ("1 process, full AC", 1, ["train.activation_checkpoint.enabled=True", "train.activation_checkpoint.mode=full"],
     501),
    ("dp2 DDP", 2, ["train.dist.data_parallel_size=2"], 605),
    ("dp2 ZeRO-1", 2, ["train.dist.data_parallel_size=2", "train.zero_optimization.enabled=True",
                       "train.zero_optimization.stage=1"], 439),
    ("dp2 ZeRO-3", 2, ["train.dist.data_parallel_size=2", "train.zero_optimization.enabled=True",
                       "train.zero_optimization.stage=3"], 375),
    ("dp2 ZeRO-3, bf16", 2, ["train.dist.data_parallel_size=2", "train.zero_optimization.enabled=True",
                             "train.zero_optimization.stage=3", "train.amp.enabled=bf16"],
     355),  # gathered in bf16 since FSDP's mixed-precision policy: plan-accuracy-2026-11-29-gpt-8x512.md (was 417)
    ("dp4 ZeRO-2", 4, ["train.dist.data_parallel_size=4", "train.zero_optimization.enabled=True",
                       "train.zero_optimization.stage=2"], 248),
    ("dp4 ZeRO-3", 4, ["train.dist.data_parallel_size=4", "train.zero_optimization.enabled=True",
                       "train.zero_optimization.stage=3"], 170),
    ("tp2", 2, ["train.dist.tensor_parallel_size=2"], 271),
    ("tp2 + SP, full AC", 2, ["train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True",
                              "train.activation_checkpoint.enabled=True", "train.activation_checkpoint.mode=full"], 272),
    ("pp2 1F1B", 2, ["train.dist.pipeline_parallel_size=2"], 294),
    ("pp2 interleaved x2", 2, ["train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=interleaved_1f1b",
                               "train.dist.virtual_pipeline_size=2"], 297),
    ("dp2 DDP x tp2", 4, ["train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2"], 308),
    ("dp2 DDP x pp2 1F1B", 4, ["train.dist.data_parallel_size=2", "train.dist.pipeline_parallel_size=2"], 355),
]


@pytest.mark.parametrize("world, overrides, measured", [r[1:] for r in PLAN_ACCURACY],
                         ids=[r[0] for r in PLAN_ACCURACY])
def test_accumulating_layouts_match_measured_runs_within_10_percent(world, overrides, measured, test_cpu):
    cfg = load("gpt_debug", *GPT30M, "train.train_micro_batch_size=1", "train.global_batch_size=4",
               "train.compile.enabled=False", *overrides)
    predicted = estimate(cfg, world, test_cpu).memory_per_gpu_bytes / MiB
    assert abs(predicted - measured) <= 0.10 * measured
