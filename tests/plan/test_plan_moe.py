"""Mixture-of-experts models in the planner: FLOPs of the experts a token uses, memory of every expert, and the
expert-parallel dimension (its memory per rank, its all-to-all, its place in the search and in the layout a run
takes)."""

from __future__ import annotations

import json

import pytest

from plan_testing import PROBE, load
from dufu.plan import apply_layout, estimate, search
from dufu.plan.search import EP_KEY

ZERO = ("train.zero_optimization.enabled=True",)

# A larger MoE decoder than moe_debug: dense and MoE blocks alternate (blocks 1 and 3 are MoE), 16 experts of
# which a token uses 4, a gated shared expert, grouped-query attention.
BIG = dict(vocab=1024, hidden=256, layers=4, heads=8, kv_heads=4, ffn=512, experts=16, top_k=4, moe_ffn=384,
           shared=256, seq=64)


def big(**changes):
    c = {**BIG, **changes}
    return ("model.vocab_size=%d" % c["vocab"], "model.hidden_size=%d" % c["hidden"],
            "model.num_layers=%d" % c["layers"], "model.num_attention_heads=%d" % c["heads"],
            "model.num_key_value_heads=%d" % c["kv_heads"], "model.ffn_hidden_size=%d" % c["ffn"],
            "model.num_experts=%d" % c["experts"], "model.top_k=%d" % c["top_k"],
            "model.moe_ffn_hidden_size=%d" % c["moe_ffn"], "model.shared_ffn_hidden_size=%d" % c["shared"],
            "model.shared_expert_gate=True", "model.moe_layer_freq=2",
            "model.max_position_embeddings=%d" % c["seq"], "dataloader.train.seq_length=%d" % c["seq"])


MOE_DEBUG = dict(vocab=384, hidden=64, layers=2, heads=4, kv_heads=2, ffn=64, experts=8, top_k=2, moe_ffn=64,
                 shared=0, seq=32, moe_every=1)


def counts(c: dict) -> dict:
    """Parameter counts of a MoE decoder of sizes ``c``, by hand: every parameter, the experts', and the ones
    one token uses (a MoE block's experts count top_k / E), the latter without the norms (the traced matmuls')."""
    h, hd = c["hidden"], c["hidden"] // c["heads"]
    attention = h * c["heads"] * hd * 2 + 2 * h * c["kv_heads"] * hd
    norms = 2 * h
    moe_blocks = [i for i in range(c["layers"]) if (i + 1) % c.get("moe_every", 2) == 0]
    total = active = experts = 0
    for i in range(c["layers"]):
        total += attention + norms
        active += attention + norms
        if i in moe_blocks:
            shared = 3 * h * c["shared"] + h if c["shared"] else 0  # the shared expert and its gate
            expert = 3 * h * c["moe_ffn"]
            total += c["experts"] * h + c["experts"] * expert + shared
            active += c["experts"] * h + c["top_k"] * expert + shared  # the router sees every expert
            experts += c["experts"] * expert
        else:
            total += 3 * h * c["ffn"]
            active += 3 * h * c["ffn"]
    head = c["vocab"] * h
    return dict(total=total + h + head + c["vocab"] * h, active=active + h + head, experts=experts,
                active_matmul=active + head - norms * c["layers"], moe_blocks=len(moe_blocks))


def one_process(test_cpu, recipe_overrides, micro=2):
    return estimate(load("moe_debug", *recipe_overrides, f"train.train_micro_batch_size={micro}"), 1, test_cpu)


@pytest.mark.parametrize("sizes, overrides", [(MOE_DEBUG, ()), (BIG, big())], ids=["moe_debug", "big"])
def test_flops_are_those_of_the_active_parameters(sizes, overrides, test_cpu):
    est = one_process(test_cpu, overrides)
    c = counts(sizes)
    h, t, layers = sizes["hidden"], sizes["seq"], sizes["layers"]
    # model FLOPs (MFU's): 6 N + 12 L H T with N the active parameters
    assert est.model_flops_per_step / est.tokens_per_step == pytest.approx(6 * c["active"] + 12 * layers * h * t,
                                                                           rel=1e-12)
    # what the traced step computes under balanced routing: every matmul of the active parameters (forward,
    # input and weight gradients) and fused attention (4 B h T^2 d forward, 2.5 times that backward)
    attention = layers * 4 * 3.5 * sizes["heads"] * t * t * (h // sizes["heads"])
    per_sample = 6 * t * c["active_matmul"] + attention
    assert est.hardware_flops_per_gpu_step == pytest.approx(per_sample * est.tokens_per_step / t, rel=1e-9)


def test_memory_holds_every_expert(test_cpu):
    est = one_process(test_cpu, big())
    c = counts(BIG)
    assert est.memory["parameters"] == pytest.approx(4 * c["total"], abs=1)
    assert est.memory["optimizer"] == pytest.approx(8 * c["total"], abs=1)


def test_more_experts_same_flops_more_memory(test_cpu):
    few = one_process(test_cpu, big(experts=16))
    many = one_process(test_cpu, big(experts=32))
    routers = 6 * counts(BIG)["moe_blocks"] * 16 * BIG["hidden"]  # the router's 16 more logits per token
    assert many.model_flops_per_step - few.model_flops_per_step == pytest.approx(routers * few.tokens_per_step)
    assert many.hardware_flops_per_gpu_step - few.hardware_flops_per_gpu_step == pytest.approx(
        routers * few.tokens_per_step)
    more = counts({**BIG, "experts": 32})["total"] - counts(BIG)["total"]
    assert many.memory["parameters"] - few.memory["parameters"] == pytest.approx(4 * more, abs=2)
    assert many.memory_per_gpu_bytes > few.memory_per_gpu_bytes + 12 * more


def test_expert_parallelism_halves_the_experts_a_rank_holds(test_cpu):
    dp2 = ("train.dist.data_parallel_size=2",)
    ep1 = estimate(load("moe_debug", *dp2), 2, test_cpu)
    ep2 = estimate(load("moe_debug", *dp2, "train.dist.expert_parallel_size=2"), 2, test_cpu)
    half = counts(MOE_DEBUG)["experts"] / 2
    assert ep1.memory["parameters"] - ep2.memory["parameters"] == pytest.approx(4 * half, abs=2)
    assert ep1.memory["optimizer"] - ep2.memory["optimizer"] == pytest.approx(8 * half, abs=2)
    assert ep2.memory_per_gpu_bytes < ep1.memory_per_gpu_bytes
    # balanced, a rank's experts multiply as many token copies with or without expert parallelism
    assert ep2.hardware_flops_per_gpu_step == pytest.approx(ep1.hardware_flops_per_gpu_step, rel=1e-9)


def test_zero_shards_the_experts_over_expert_data(test_cpu):
    """ZeRO shards a rank's E / ep experts over the dp / ep ranks of expert_data: the experts' states per rank are
    1 / dp of them at every expert-parallel size; the gathered experts of ZeRO-3 are those of E / ep."""
    dp4 = ("train.dist.data_parallel_size=4", *ZERO, "train.zero_optimization.stage=3")
    by_ep = {ep: estimate(load("moe_debug", *dp4, f"train.dist.expert_parallel_size={ep}"), 4, test_cpu)
             for ep in (1, 2, 4)}
    for ep in (2, 4):
        assert by_ep[ep].memory["parameters"] == pytest.approx(by_ep[1].memory["parameters"], abs=2)
        assert by_ep[ep].memory["optimizer"] == pytest.approx(by_ep[1].memory["optimizer"], abs=2)
    assert by_ep[4].memory["communication"] < by_ep[2].memory["communication"] < by_ep[1].memory["communication"]


def test_all_to_all_is_priced_from_the_tokens_exchanged(test_cpu):
    """Per MoE layer and micro-batch: the counts, the dispatch and the combine forward, the two again backward;
    each moves (ep - 1) / ep of the rank's token copies (tokens x top_k x hidden, fp32) in ep - 1 steps, at the
    gloo all-reduce's bandwidth; plus the experts' gradient-norm all-reduce once per step."""
    micro = 4
    est = estimate(load("moe_debug", "train.dist.data_parallel_size=2", "train.dist.expert_parallel_size=2",
                        f"train.train_micro_batch_size={micro}"), 2, test_cpu)
    bw, step = PROBE["gloo_bandwidth"], PROBE["gloo_latency_s"] / 2
    copies = micro * MOE_DEBUG["seq"] * MOE_DEBUG["top_k"] * MOE_DEBUG["hidden"] * 4
    tokens = 0.5 * copies / bw + step
    counts_ = 0.5 * 8 * MOE_DEBUG["experts"] / bw + step
    norm = 2 * 0.5 * 4 / bw + 2 * step
    expected = MOE_DEBUG["layers"] * (counts_ + 4 * tokens) + norm
    assert est.time["ep_comm"] == pytest.approx(expected, rel=1e-9)
    dense = estimate(load("moe_debug", "train.dist.data_parallel_size=2", f"train.train_micro_batch_size={micro}"),
                     2, test_cpu)
    assert dense.time["ep_comm"] == 0.0
    assert est.step_time_s == pytest.approx(sum(v for k, v in est.time.items() if k != "dp_comm"))


def test_checkpointing_and_capacity(test_cpu):
    """Full recomputation repeats the forward's exchanges; a capacity caps each expert's tokens (balanced: at
    capacity factor 1 nothing is dropped, at 0.5 half of it)."""
    base = ("train.dist.data_parallel_size=2", "train.dist.expert_parallel_size=2")
    plain = estimate(load("moe_debug", *base), 2, test_cpu)
    full = estimate(load("moe_debug", *base, "train.activation_checkpoint.enabled=True",
                         "train.activation_checkpoint.mode=full"), 2, test_cpu)
    assert full.time["ep_comm"] > plain.time["ep_comm"]
    one = one_process(test_cpu, ("model.capacity_factor=1.0",))
    half = one_process(test_cpu, ("model.capacity_factor=0.5",))
    dropless = one_process(test_cpu, ())
    assert one.hardware_flops_per_gpu_step == dropless.hardware_flops_per_gpu_step
    experts = 6 * counts(MOE_DEBUG)["experts"] * MOE_DEBUG["top_k"] / MOE_DEBUG["experts"]
    assert dropless.hardware_flops_per_gpu_step - half.hardware_flops_per_gpu_step == pytest.approx(
        0.5 * experts * dropless.tokens_per_step)


def plan_json(capsys, *argv):
    from dufu.cli import main

    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_search_lists_expert_parallel_layouts_for_moe_only(capsys):
    auto = ("train.dist.auto=True", "train.global_batch_size=16")
    data = plan_json(capsys, "moe_debug", "--gpus", "4", "--gpu", "a100-80gb", *auto)
    assert EP_KEY in data["auto"]
    eps = {e["expert_parallel_size"] for e in data["layouts"]}
    assert eps == {1, 2, 4}
    assert all(e["data_parallel_size"] % e["expert_parallel_size"] == 0 for e in data["layouts"])
    dense = plan_json(capsys, "gpt_debug", "--gpus", "4", "--gpu", "a100-80gb", *auto)
    assert EP_KEY not in dense["auto"]
    assert {e["expert_parallel_size"] for e in dense["layouts"]} == {1}


def test_expert_parallel_sizes_divide_data_parallelism_and_the_experts():
    from dufu.plan.search import model_info

    assert model_info(load("moe_debug")).expert_parallel_sizes(4) == [1, 2, 4]
    assert model_info(load("moe_debug")).expert_parallel_sizes(6) == [1, 2]
    assert model_info(load("moe_debug", "model.num_experts=6")).expert_parallel_sizes(4) == [1, 2]
    assert model_info(load("gpt_debug")).expert_parallel_sizes(4) == [1]


def test_the_chosen_expert_parallel_size_reaches_the_run(test_cpu):
    from dufu.plan import get_hardware
    from dufu.plan.auto import resolve_auto_layout, resolved_overrides

    cfg = load("moe_debug", "train.dist.auto=True", "train.global_batch_size=16")
    ep = search(cfg, 4, "a100-80gb").best.layout["expert_parallel_size"]
    notice = resolve_auto_layout(cfg, 4, get_hardware("a100-80gb"))
    # tiny experts on a GPU are bound by launches: a rank running 8 / ep experts launches fewer
    assert ep > 1 and cfg.train.dist.expert_parallel_size == ep
    assert f"experts over ep {ep}" in notice
    assert f"train.dist.expert_parallel_size={ep}" in resolved_overrides(cfg)
    # an ep layout written back into the config is estimated alike
    config = load("moe_debug", "train.dist.auto=True", "train.global_batch_size=16")
    for candidate in [e for e in search(config, 4, test_cpu) if e.layout["expert_parallel_size"] > 1][:2]:
        again = estimate(apply_layout(config, candidate.layout), 4, test_cpu)
        assert again.layout == candidate.layout
        assert again.step_time_s == candidate.step_time_s
        assert again.memory_per_gpu_bytes == candidate.memory_per_gpu_bytes


def test_a_dense_model_refuses_expert_parallelism(test_cpu):
    from dufu.errors import LayoutError

    with pytest.raises(LayoutError, match="no mixture-of-experts layer"):
        estimate(load("gpt_debug", "train.dist.data_parallel_size=2", "train.dist.expert_parallel_size=2"), 2,
                 test_cpu)
