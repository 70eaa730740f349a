"""The planner on the layouts and optimizers start-up knows: V-shaped pipeline schedules (ZB-V, DualPipeV), hybrid
sharding (HSDP), context parallelism's all-to-all modes (Ulysses, hierarchical), Muon's and SGD's optimizer state,
refused where ``dufu train`` refuses them, with its messages."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from plan_testing import load
from dufu.config import ConfigDict
from dufu.errors import LayoutError
from dufu.optim import muon_param_groups
from dufu.plan import estimate
from dufu.plan.hardware import CATALOG
from dufu.plan.layout import setup_from_config
from dufu.plan.memory import in_flight, rank_parts
from dufu.plan.optimizer import MUON_STEP_BYTES, optimizer_step_temporaries
from dufu.plan.search import apply_layout, layout_from_config, model_info
from dufu.plan.timing import estimate_time
from dufu.plan.trace import get_trace

GPU = replace(CATALOG["a100-80gb"], memory_bytes=10 * 2**30, reserved_bytes=0)
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")


def test_the_planner_refuses_what_start_up_refuses():
    # hybrid sharding without ZeRO
    with pytest.raises(LayoutError, match="data_parallel_replicate_size = 2 makes 2 replicas"):
        estimate(load("gpt_debug", "train.dist.data_parallel_size=4", "train.dist.data_parallel_replicate_size=2"),
                 4, GPU)
    # a split backward (ZB-V) under ZeRO-3
    with pytest.raises(LayoutError, match="zbv schedule computes weight gradients apart"):
        estimate(load("gpt_debug", "model.num_layers=4", "train.dist.pipeline_parallel_size=2",
                      "train.dist.data_parallel_size=2", "train.dist.pipeline_schedule=zbv",
                      "train.dist.virtual_pipeline_size=2", "train.num_accumulation_steps=4", *ZERO3), 4, GPU)
    # Ulysses over more ranks than the heads split into (8 heads over 16 ranks)
    with pytest.raises(LayoutError, match="context_parallel_mode=all_to_all splits the attention heads"):
        estimate(llama("train.dist.context_parallel_size=16", "train.dist.context_parallel_mode=all_to_all"), 16, GPU)


def test_layouts_carry_the_new_keys_back_into_the_config():
    cfg = load("gpt_debug", "train.dist.data_parallel_size=4", "train.dist.data_parallel_replicate_size=2", *ZERO3)
    layout = layout_from_config(cfg, 4)
    assert (layout.data_parallel_replicate_size, layout.data_shard_size) == (2, 2)
    est = estimate(cfg, 4, GPU)
    back = apply_layout(load("gpt_debug"), est.layout)
    assert back.train.dist.data_parallel_replicate_size == 2 and back.train.zero_optimization.stage == 3
    assert "hybrid sharding (2 replicas)" in est.layout_summary()
    assert setup_from_config(load("gpt_debug_muon"), GPU).optimizer == "muon"
    assert setup_from_config(load("gpt_debug"), GPU).optimizer == "adamw"


def test_v_schedules_place_a_v_hold_pp_micro_batches_and_leave_a_sixth_of_the_1f1b_bubble(test_cpu):
    base = ("model.num_layers=4", "train.dist.pipeline_parallel_size=2", "train.num_accumulation_steps=8",
            "train.train_micro_batch_size=1", "train.dist.virtual_pipeline_size=2")
    results = {}
    for schedule in ("zbv", "dualpipev", "interleaved_1f1b"):
        cfg = load("gpt_debug", *base, f"train.dist.pipeline_schedule={schedule}")
        info, setup, layout = model_info(cfg), setup_from_config(cfg, test_cpu), layout_from_config(cfg, 2)
        # rank 0 holds stages 0 and 3 (the first and last block, the embeddings and the head), rank 1 stages 1, 2
        parts = rank_parts(info, layout, setup)
        if schedule != "interleaved_1f1b":
            assert parts == [[0, 1, 4, 5], [2, 3]]
        else:
            assert parts == [[0, 1, 3], [2, 4, 5]]
        # torch's action lists: every rank holds pp micro-batches (DualPipeV one half more)
        assert [in_flight(layout, r) for r in range(2)] == {"zbv": [2.0, 2.0], "dualpipev": [2.5, 2.5]}.get(
            schedule, [in_flight(layout, 0), in_flight(layout, 1)])
        trace = get_trace(info, setup.dtype, None, "cpu")
        times, details = estimate_time(info, trace, layout, setup, test_cpu, 2)
        results[schedule] = (times, details)
    for schedule, divisor in (("zbv", 6), ("dualpipev", 6), ("interleaved_1f1b", 2)):
        times, details = results[schedule]
        assert times["bubble"] == pytest.approx(details["slot_s"] / divisor, rel=1e-9)
    assert results["zbv"][0]["bubble"] < 0.5 * results["interleaved_1f1b"][0]["bubble"]


def _muon_elems(cfg) -> tuple[int, int]:
    from dufu.config import instantiate

    with torch.device("meta"):
        model = instantiate(cfg.model)
    mats = [p for g in muon_param_groups(model) if g["use_muon"] for p in g["params"]]
    return sum(p.numel() for p in mats), max(p.numel() for p in mats)


def test_muon_keeps_one_buffer_for_its_matrices_and_sgd_one_or_none():
    adamw = estimate(load("gpt_debug", "train.train_micro_batch_size=1"), 1, GPU)
    muon = estimate(load("gpt_debug_muon", "train.train_micro_batch_size=1"), 1, GPU)
    matrices, largest = _muon_elems(load("gpt_debug"))
    assert matrices > 0.2 * adamw.model_states["parameters"] / 4  # the hidden matrices: a real share
    assert adamw.model_states["optimizer"] - muon.model_states["optimizer"] == 4 * matrices
    assert muon.model_states["parameters"] == adamw.model_states["parameters"]
    # the optimizer step's Newton-Schulz iterate of the largest matrix, whole
    assert muon.time["optimizer"] > adamw.time["optimizer"]
    # under ZeRO-3 over 2 ranks the momentum is sharded like the parameters
    muon2 = estimate(load("gpt_debug_muon", "train.train_micro_batch_size=1", "train.dist.data_parallel_size=2",
                          *ZERO3), 2, GPU)
    assert muon2.model_states["optimizer"] == pytest.approx(muon.model_states["optimizer"] / 2, abs=8)
    # the optimizer step's moment: the Newton-Schulz iteration of the largest matrix, whole (gpt_debug: 64 x 256)
    cfg = load("gpt_debug_muon")
    info = model_info(cfg)
    assert largest == 64 * 256
    assert optimizer_step_temporaries(info, list(range(len(info.parts))), setup_from_config(cfg, GPU)) == \
        MUON_STEP_BYTES * largest
    for momentum, per in ((0.9, 4), (0.0, 0)):
        cfg = load("gpt_debug", "train.train_micro_batch_size=1")
        cfg.optim = ConfigDict({"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": momentum})
        sgd = estimate(cfg, 1, GPU)
        assert sgd.model_states["optimizer"] == per * adamw.model_states["parameters"] / 4


def test_hybrid_sharding_shards_within_a_replica_and_all_reduces_across(test_cpu):
    hsdp = estimate(load("gpt_debug", "train.train_micro_batch_size=1", "train.dist.data_parallel_size=4",
                         "train.dist.data_parallel_replicate_size=2", *ZERO3), 4, GPU)
    dp2 = estimate(load("gpt_debug", "train.train_micro_batch_size=1", "train.dist.data_parallel_size=2", *ZERO3),
                   2, GPU)
    dp4 = estimate(load("gpt_debug", "train.train_micro_batch_size=1", "train.dist.data_parallel_size=4", *ZERO3),
                   4, GPU)
    # states as ZeRO over one replica's 2 ranks, twice those over all 4
    assert hsdp.model_states == dp2.model_states
    assert hsdp.model_states["optimizer"] == pytest.approx(2 * dp4.model_states["optimizer"], abs=16)
    # the gradient: dp2's reduce-scatter over the 2 ranks of a replica, plus a ring all-reduce of each rank's half
    # shard (fp32) with the other replica: 2 (R - 1) / R x bytes / bandwidth, 2 (R - 1) latencies per FSDP unit
    # (2 blocks and the root); both inside one node
    bw, lat = GPU.intra_node_bandwidth * GPU.comm_efficiency, GPU.intra_latency_s
    shard = 4 * 126_720 / 2  # gpt_debug's 126,720 parameters
    assert hsdp.time["dp_comm"] - dp2.time["dp_comm"] == pytest.approx(shard / bw + 3 * 2 * lat, rel=1e-6)


def llama(*overrides):
    """A small LLaMA (fp32): 2 layers, hidden 256, 8 query heads over 1 key/value head, sequence 256."""
    return load("llama_debug", "model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=8",
                "model.num_key_value_heads=1", "model.ffn_hidden_size=512", "model.vocab_size=256",
                "model.max_position_embeddings=256", "dataloader.train.seq_length=256", *overrides)


def test_ulysses_and_hierarchical_context_parallelism_trace_their_all_to_alls():
    T, H, heads = 256, 256, 8
    q_bytes = T // 2 * H * 4  # one sample's local queries at cp 2, fp32
    cfg = llama("train.train_micro_batch_size=1", "train.dist.context_parallel_size=2",
                "train.dist.context_parallel_mode=all_to_all")
    est = estimate(cfg, 2, GPU)
    layout = layout_from_config(cfg, 2)
    assert layout.context_a2a_size == 2
    trace = get_trace(model_info(cfg), "fp32", None, "cuda", 1, 2, 2)
    block = trace.parts.index("block 0")
    fwd = [g for g in trace.kv_gathers if g.part == block and not g.backward]
    # q, k and v (its 1 key/value head repeated to 2, so each rank takes one) and the output: 2 + 2 x 2 / 8 q's
    assert [g.kind for g in fwd] == ["all_to_all"] * 4
    assert sum(g.nbytes[0] for g in fwd) == pytest.approx((2 + 2 * 2 / heads) * q_bytes)
    assert len([g for g in trace.kv_gathers if g.part == block and g.backward]) == 4
    assert est.time["cp_comm"] > 0
    # hierarchical at cp 4: all-to-alls inside pairs, K and V all-gathered across the 2 pairs
    cfg4 = llama("train.train_micro_batch_size=1", "train.dist.context_parallel_size=4",
                 "train.dist.context_parallel_mode=hierarchical", "train.dist.context_parallel_a2a_size=2")
    estimate(cfg4, 4, GPU)
    trace4 = get_trace(model_info(cfg4), "fp32", None, "cuda", 1, 4, 2)
    kinds = {(g.kind, g.ranks) for g in trace4.kv_gathers if g.part == block}
    assert kinds == {("all_to_all", 2), ("all_gather", 2), ("reduce_scatter", 2)}
