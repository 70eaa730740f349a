"""Context parallelism in the planner: a rank's memory and time for T / cp tokens plus the gathered K and V, the
context-parallel size in the search (only where it can matter, never for a family that refuses it), the refusals
with dufu train's own messages, and the chosen size written back into the config."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plan_testing import load
from dufu.errors import LayoutError
from dufu.plan import estimate, search
from dufu.plan.hardware import CATALOG

# A small LLaMA (fp32, as llama_debug trains) with a long sequence: 2 layers, hidden 256, 8 heads over 1 key/value
# head (so tensor parallelism cannot split it: the search's alternatives are data, pipeline and context
# parallelism), sequence 1024. The trace runs on fake tensors, so a long sequence costs no time.
T, H, HEADS, KV, LAYERS = 1024, 256, 8, 1, 2
LONG = (f"model.num_layers={LAYERS}", f"model.hidden_size={H}", f"model.num_attention_heads={HEADS}",
        f"model.num_key_value_heads={KV}", "model.ffn_hidden_size=512", "model.vocab_size=256",
        f"model.max_position_embeddings={T}", f"dataloader.train.seq_length={T}")


def llama(*overrides):
    return load("llama_debug", *LONG, *overrides)


# A GPU of the catalog with room for every layout here (the trace is then one of the "cuda" device: dropout-free
# fused attention); the search test narrows it.
GPU = replace(CATALOG["a100-80gb"], memory_bytes=10 * 2**30, reserved_bytes=0)


def cp_estimate(cp: int, hw=GPU, *overrides):
    return estimate(llama("train.train_micro_batch_size=1", f"train.dist.context_parallel_size={cp}", *overrides),
                    cp, hw)


def test_a_rank_keeps_its_share_of_the_activations_plus_the_gathered_keys_and_values():
    one = cp_estimate(1)
    for cp in (2, 4):
        est = cp_estimate(cp)
        # per layer, beyond its share of one device's activations: K and V of the whole sequence (fp32) as gathered
        # (1 head), and no mask (the mask-free causal kernel, on a GPU as on the CPU); one device's attention keeps
        # K and V repeated to the 8 query heads, the split one repeats them per kernel call only, so a rank keeps
        # less than 1 / cp of one device's activations here (measured: 0.35 at cp 2, 0.18 at cp 4)
        kv = 2 * T * KV * (H // HEADS) * 4
        share = one.memory["activations"] / cp
        assert 0.6 * share < est.memory["activations"] <= 1.05 * (share + LAYERS * kv)
        assert est.memory["activations"] < 0.7 / (cp / 2) * one.memory["activations"]
        # model states as one device's (no ZeRO: dp x cp ranks each hold every parameter)
        assert est.memory["parameters"] == one.memory["parameters"]
        # per layer an all-gather of K and one of V forward, their reduce-scatters backward
        assert est.time["cp_comm"] > 0 and est.layout["context_parallel_size"] == cp
        assert est.hardware_flops_per_gpu_step < 0.6 / (cp / 2) * one.hardware_flops_per_gpu_step
    # full activation checkpointing gathers K and V again when it recomputes a block: 3 collectives instead of 2
    full = cp_estimate(2, GPU, "train.activation_checkpoint.enabled=True", "train.activation_checkpoint.mode=full")
    assert full.time["cp_comm"] == pytest.approx(1.5 * cp_estimate(2).time["cp_comm"], rel=1e-9)


def test_zero_shards_over_data_and_context_ranks():
    zero = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")
    dp2 = estimate(llama("train.train_micro_batch_size=1", "train.dist.data_parallel_size=2", *zero), 2, GPU)
    cp2 = cp_estimate(2, GPU, *zero)
    assert cp2.memory["optimizer"] == pytest.approx(dp2.memory["optimizer"], rel=1e-6)
    assert cp2.memory["parameters"] == pytest.approx(dp2.memory["parameters"], rel=1e-6)


def test_the_search_splits_the_sequence_when_no_sample_fits_one_device():
    roomy = GPU
    auto = ("train.dist.auto=True", "train.global_batch_size=2")
    # every layout of 2 ranks, with and without context parallelism (set to auto, it is searched whatever fits)
    plan = search(llama(*auto, "train.dist.context_parallel_size=auto"), 2, roomy)
    need = {cp: min(e.memory_per_gpu_bytes for e in plan if e.layout["context_parallel_size"] == cp) for cp in (1, 2)}
    assert need[2] < 0.9 * need[1]
    # a device between the two: no layout without cp fits (the model offers no tensor parallelism), so
    # train.dist.auto=True searches cp, and the best layout splits every sample over both ranks
    tight = replace(roomy, memory_bytes=(need[1] + need[2]) // 2)
    plan = search(llama(*auto), 2, tight)
    assert "train.dist.context_parallel_size" in plan.auto
    best = plan.best
    assert best is not None and best.layout["context_parallel_size"] == 2 and best.layout["data_parallel_size"] == 1
    assert all(not e.fits for e in plan if e.layout["context_parallel_size"] == 1)
    # where layouts without it fit (and the batch has a sample per rank), train.dist.auto=True does not search cp
    plan = search(llama(*auto), 2, roomy)
    assert "train.dist.context_parallel_size" not in plan.auto
    assert {e.layout["context_parallel_size"] for e in plan} == {1}


def test_a_model_without_support_is_never_split():
    # BERT for classification (its label is read from one token) never gets cp, even when nothing fits
    tiny = replace(GPU, memory_bytes=2**20)
    plan = search(load("bert_classify_debug", "train.dist.auto=True", "train.global_batch_size=2"), 2, tiny)
    assert plan.best is None and "train.dist.context_parallel_size" not in plan.auto
    assert {e.layout["context_parallel_size"] for e in plan} == {1}


def test_layouts_dufu_train_refuses_are_counted_with_its_message(test_cpu):
    # explicit auto: every divisor of the world size is a candidate; 2 x 3 and 2 x 6 chunks do not divide 1024
    plan = search(llama("train.dist.context_parallel_size=auto", "train.dist.data_parallel_size=auto",
                        "train.train_micro_batch_size=1"), 6, GPU)
    refused = {layout.get("context_parallel_size"): why for layout, why in plan.rejected}
    assert "2 x cp = 6 chunks" in refused[3] and "nearest: 1020 or 1026" in refused[3]
    assert "2 x cp = 12 chunks" in refused[6]
    assert {e.layout["context_parallel_size"] for e in plan} == {1, 2}
    with pytest.raises(LayoutError, match="2 x cp = 6 chunks"):
        cp_estimate(3)
    with pytest.raises(LayoutError, match="cannot be split by context parallelism"):
        estimate(load("bert_classify_debug", "train.dist.context_parallel_size=2"), 2, test_cpu)
    with pytest.raises(LayoutError, match="not supported together"):
        estimate(load("moe_debug", "train.dist.data_parallel_size=2", "train.dist.expert_parallel_size=2",
                      "train.dist.context_parallel_size=2"), 4, test_cpu)


def test_the_chosen_size_is_written_back():
    from dufu.plan.auto import resolve_auto_layout, resolved_overrides
    from dufu.plan.search import apply_layout

    cfg = llama("train.dist.context_parallel_size=auto", "train.dist.data_parallel_size=auto",
                "train.train_micro_batch_size=1")
    chosen = search(cfg, 2, GPU)
    cp = chosen.best.layout["context_parallel_size"]
    notice = resolve_auto_layout(cfg, 2, GPU)
    assert cfg.train.dist.context_parallel_size == cp and "context_parallel_size" in notice
    assert f"train.dist.context_parallel_size={cp}" in resolved_overrides(cfg)
    for e in chosen[:2]:  # and a searched layout applied to the config is estimated alike
        again = estimate(apply_layout(cfg, e.layout), 2, GPU)
        assert again.layout == e.layout and again.step_time_s == e.step_time_s


def test_the_rule_also_splits_samples_when_the_batch_has_fewer_than_the_processes():
    from types import SimpleNamespace

    from dufu.plan.search import _context_pass, model_info

    fits = [SimpleNamespace(fits=True)]
    cfg = llama("train.dist.auto=True", "train.global_batch_size=2")
    info = model_info(cfg)
    assert _context_pass(cfg, info, [], fits, 4) == [2, 4]  # 2 samples, 4 processes: sizes whose chunks divide 1024
    assert _context_pass(cfg, info, [], fits, 2) == []  # a sample per process, and layouts that fit
    assert _context_pass(cfg, info, [], [SimpleNamespace(fits=False)], 2) == [2]
    assert _context_pass(cfg, info, ["train.dist.context_parallel_size"], [], 2) == []  # set to auto: searched anyway
