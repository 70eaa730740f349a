"""dufu.layers.MoE against transformers' Mixtral sparse MoE block (same weights), and its capacity rule."""

from __future__ import annotations

import pytest
import torch

from dufu.layers.moe import MoE


def _pair(top_k=2, experts=4):
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=experts,
                                     num_experts_per_tok=top_k, router_jitter_noise=0.0)
    torch.manual_seed(0)
    ref = MixtralSparseMoeBlock(cfg).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MoE(32, 48, experts, top_k=top_k, aux_loss_coeff=1.0)
    ours.router.weight.data.copy_(ref.gate.weight)
    ours.experts.gate_up_proj.data.copy_(ref.experts.gate_up_proj)
    ours.experts.down_proj.data.copy_(ref.experts.down_proj)
    return ref, ours, load_balancing_loss_func


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_equals_mixtrals_block_and_its_load_balancing_loss(top_k):
    ref, ours, lb_loss = _pair(top_k)
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        expected = ref(x)
        got = ours(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    logits = ours.router(x.view(-1, 32))
    assert ours.aux_loss.item() == pytest.approx(lb_loss((logits,), 4, top_k).item(), rel=1e-5)
    assert int(ours.tokens_per_expert.sum()) == 21 * top_k


def test_gradients_reach_every_used_expert_and_the_router():
    _, ours, _ = _pair()
    x = torch.randn(2, 5, 32)
    (ours(x).square().sum() + ours.aux_loss).backward()
    used = ours.tokens_per_expert > 0
    assert ours.router.weight.grad.abs().sum() > 0
    assert (ours.experts.gate_up_proj.grad.flatten(1).abs().sum(1) > 0).eq(used).all()


def test_capacity_drops_assignments_first_come_first_served():
    torch.manual_seed(1)
    moe = MoE(16, 24, 4, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0  # every token prefers expert 2
    x = torch.rand(1, 8, 16) + 0.1  # positive inputs: expert 2's logit is the largest for all 8
    out = moe(x)
    assert moe.tokens_per_expert.tolist() == [0, 0, 2, 0]  # capacity ceil(1.0 x 8 / 4) = 2
    kept = out[0].abs().sum(-1) > 0
    assert kept.tolist() == [True, True] + [False] * 6  # the first two tokens in order
    big = MoE(16, 24, 4, top_k=1, capacity_factor=100.0)
    big.load_state_dict(moe.state_dict())
    dropless = MoE(16, 24, 4, top_k=1)
    dropless.load_state_dict(moe.state_dict())
    torch.testing.assert_close(big(x), dropless(x))


def test_shared_experts_add_a_dense_mlp_every_token_goes_through():
    torch.manual_seed(2)
    routed = MoE(16, 24, 4, top_k=2)
    both = MoE(16, 24, 4, top_k=2, shared_ffn_hidden_size=20)
    both.load_state_dict({**routed.state_dict(), **{k: v for k, v in both.state_dict().items() if k.startswith("shared.")}})
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(both(x), routed(x) + both.shared(x.view(-1, 16)).view(2, 3, 16))
