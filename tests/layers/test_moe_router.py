"""DeepSeekMoE routing in dufu.layers.MoE: sigmoid scores, group-limited routing and the routed scaling factor
against transformers' DeepseekV3TopkRouter and DeepseekV3MoE (same weights and bias); auxiliary-loss-free
balancing's bias (moved by gamma x sign of the load error, untouched by gradients and the optimizer, updated by
the training hook from the step's counts); the sequence-wise balance loss against its formula (DeepSeek-V3 eq.
17-20); settings that do not combine. The multi-process runs (dp2, ep2, a resume) are in
tests/parallel/test_expert_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dufu.engine.host_reads import count_host_reads
from dufu.engine.moe_balance import LoadBalance
from dufu.engine.moe_monitor import MoEMonitor
from dufu.layers.moe import MoE, grouped_mm_available

H, F, E = 32, 16, 8


def _deepseek_pair(n_group=4, topk_group=2, top_k=3, norm_topk_prob=True, scaling=2.5):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=top_k, n_group=n_group,
        topk_group=topk_group, n_shared_experts=2, routed_scaling_factor=scaling, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    ref = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(std=0.2)
        ref.gate.e_score_correction_bias.normal_(std=0.1)  # a bias that changes choices
    ours = MoE(H, F, E, top_k=top_k, norm_topk_prob=norm_topk_prob, shared_ffn_hidden_size=2 * F,
               score_func="sigmoid", n_group=n_group, topk_group=topk_group, routed_scaling_factor=scaling,
               score_bias=True)
    with torch.no_grad():
        ours.router.weight.copy_(ref.gate.weight)
        ours.score_bias.copy_(ref.gate.e_score_correction_bias)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.copy_(ref.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared, name).weight.copy_(getattr(ref.shared_experts, name).weight)
    return ref, ours


@pytest.mark.parametrize("n_group,topk_group,top_k,norm", [(4, 2, 3, True), (4, 1, 2, False), (1, 1, 2, True)])
def test_sigmoid_group_limited_router_equals_deepseek_v3s(n_group, topk_group, top_k, norm):
    ref, ours = _deepseek_pair(n_group, topk_group, top_k, norm)
    x = torch.randn(3, 11, H)
    with torch.no_grad():
        _, ref_weights, ref_experts = ref.gate(x)
        _, weights, experts = ours.route(x.view(-1, H))
        # transformers' top-k is unsorted: compare each token's (expert, weight) pairs in expert order
        ref_experts, order = ref_experts.sort(-1)
        ref_weights = ref_weights.gather(1, order)
        experts, order = experts.sort(-1)
        weights = weights.gather(1, order)
        assert torch.equal(experts, ref_experts)
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)
        if n_group > 1:  # every token's experts lie in at most topk_group groups
            assert all(len(set((row // (E // n_group)).tolist())) <= topk_group for row in experts)
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)  # with the shared experts


def test_the_bias_chooses_experts_but_never_weighs_them():
    moe = MoE(H, F, E, top_k=2, score_func="sigmoid", score_bias=True, norm_topk_prob=False)
    x = torch.randn(20, H)
    with torch.no_grad():
        moe.score_bias[5] = 10.0  # every token now takes expert 5
        logits, weights, experts = moe.route(x)
    assert (experts == 5).any(-1).all()
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, experts))  # the unbiased scores


def test_the_bias_moves_by_gamma_sign_and_not_by_gradients_or_the_optimizer():
    torch.manual_seed(0)
    moe = MoE(H, F, E, top_k=2, score_func="sigmoid", score_bias=True, bias_update_rate=1e-3,
              seq_aux_loss_coeff=0.01)
    assert "score_bias" in moe.state_dict() and "score_bias" not in dict(moe.named_parameters())
    start = torch.tensor([0.05, -0.02, 0.0, 0.01, 0.0, -0.03, 0.02, 0.0])
    with torch.no_grad():
        moe.score_bias.copy_(start)
    opt = torch.optim.AdamW(moe.parameters(), lr=0.1, weight_decay=0.5)
    for _ in range(2):
        moe(torch.randn(2, 6, H)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(moe.score_bias, start) and not moe.score_bias.requires_grad
    load = torch.tensor([9, 1, 4, 4, 0, 7, 4, 3])  # mean 4
    moe.update_score_bias(load)
    sign = torch.tensor([-1.0, 1, 0, 0, 1, -1, 0, 1])
    torch.testing.assert_close(moe.score_bias, start + 1e-3 * sign, rtol=0, atol=0)
    moe.update_score_bias(load, scale=torch.tensor(0.0))  # a skipped step
    torch.testing.assert_close(moe.score_bias, start + 1e-3 * sign, rtol=0, atol=0)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_sequence_wise_balance_loss_equals_its_formula(score_func):
    torch.manual_seed(1)
    k, alpha = 2, 0.3
    moe = MoE(H, F, E, top_k=k, score_func=score_func, seq_aux_loss_coeff=alpha, score_bias=True)
    with torch.no_grad():
        moe.score_bias.normal_(std=0.1)
    x = torch.randn(3, 10, H)
    moe(x)
    expected = 0.0
    for row in x.detach():  # one sequence at a time, DeepSeek-V3 eq. 17-20
        logits, _, experts = moe.route(row)
        logits = logits.detach()
        s = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        s = s / s.sum(-1, keepdim=True)  # s'_{i,t}
        t = row.shape[0]
        f = torch.tensor([(experts == i).sum().item() for i in range(E)]) * E / (k * t)
        expected += alpha * float((f * s.mean(0)).sum()) / len(x)
    assert moe.aux_loss.item() == pytest.approx(expected, rel=1e-6)
    # a balanced router would give alpha: the loss is alpha x E / k x sum_i (k / E)(1 / E) when f_i = 1, P_i = 1/E
    assert 0.5 * alpha < expected < 3 * alpha


def test_the_sequence_loss_reaches_the_router_and_the_routing_reads_nothing_on_the_host():
    torch.manual_seed(2)
    moe = MoE(H, F, E, top_k=2, score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.0,
              score_bias=True, seq_aux_loss_coeff=0.1)
    x = torch.randn(2, 8, H, requires_grad=True)
    if grouped_mm_available(x.device, x.dtype):  # probed first: the probe's own reads are not the layer's
        with count_host_reads() as reads:
            moe(x).sum().backward()
        assert reads.count == 0, reads.by_site
    g_with = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    moe.seq_aux_loss_coeff = 0.0
    moe(x).sum().backward()
    assert (g_with - moe.router.weight.grad).abs().max() > 1e-6  # the loss has a gradient of its own


@pytest.mark.parametrize("kwargs,match", [
    (dict(score_func="tanh"), "score_func 'tanh' is not one of"),
    (dict(n_group=3), "n_group 3 must be a whole number >= 1 that divides num_experts 8"),
    (dict(n_group=8), "1 expert per group"),
    (dict(n_group=4, topk_group=5), "topk_group 5 must be between 1 and n_group 4"),
    (dict(n_group=4, topk_group=1, top_k=3), "top_k 3 experts cannot be chosen from topk_group 1 groups of 2"),
    (dict(bias_update_rate=1e-3), "set score_bias=True"),
    (dict(bias_update_rate=-1.0, score_bias=True), "must be >= 0"),
    (dict(score_func="sigmoid", z_loss_coeff=1e-3), "Set z_loss_coeff=0 with score_func='sigmoid'"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor 0.0 must be positive"),
])
def test_settings_that_do_not_combine_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoE(H, F, E, **{"top_k": 2, **kwargs})


def test_only_the_sequence_loss_refuses_context_parallelism():
    assert MoE(H, F, E, score_func="sigmoid", score_bias=True, bias_update_rate=1e-3
               ).context_parallel_unsupported_reason is None
    reason = MoE(H, F, E, seq_aux_loss_coeff=1e-4).context_parallel_unsupported_reason
    assert "seq_aux_loss_coeff" in reason and "context parallelism" in reason


def test_the_hook_updates_from_the_counts_the_monitor_took_and_skips_a_skipped_step(tmp_path):
    """One process: the monitor pops the layers' statistics once and the balance hook reads its step counts."""
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"a": MoE(H, F, E, top_k=2, score_func="sigmoid", score_bias=True,
                                          bias_update_rate=0.01),
                                 "b": MoE(H, F, E, top_k=2)})  # no bias: left alone
    monitor = MoEMonitor(tmp_path, model)
    runtime = SimpleNamespace(model_parts=[model], num_accumulation_steps=2, schedule=None, scaler=None,
                              data_group=lambda: None, tp_rank=0, world_size=1, is_main=True)
    trainer = SimpleNamespace(runtime=runtime, is_main=True, tp_rank=0, world_size=1)
    hook = LoadBalance(monitor)
    counts = torch.zeros(E, dtype=torch.long)
    for _ in range(2):  # two micro-batches
        model["b"](model["a"](torch.randn(2, 5, H)))
        counts += model["a"].tokens_per_expert
    monitor.after_backward(trainer, torch.zeros(()))
    assert torch.equal(monitor.step_counts["a"], counts)
    hook.after_optimizer(trainer, torch.zeros(()), torch.tensor(float("inf")))  # update skipped
    assert torch.equal(model["a"].score_bias, torch.zeros(E))
    hook.after_optimizer(trainer, torch.zeros(()), torch.tensor(1.0))
    expected = 0.01 * torch.sign(counts.float().mean() - counts.float())
    assert torch.equal(model["a"].score_bias, expected) and expected.abs().sum() > 0
    load_b = monitor.step_counts["b"].double()
    record = monitor.record(runtime, step=1)  # the monitor still has its window: nothing was taken from it
    loads = [float(counts.max() / counts.double().mean()), float(load_b.max() / load_b.mean())]
    assert record["moe_max_load_step"] == pytest.approx(sum(loads) / 2, rel=1e-12) and min(loads) > 1.0
    assert record["moe_max_load"] == pytest.approx(record["moe_max_load_step"], rel=1e-12)  # one step
