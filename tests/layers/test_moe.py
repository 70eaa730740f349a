"""dufu.layers.MoE against transformers' Mixtral sparse MoE block (same weights), and its capacity rule."""

from __future__ import annotations

import pytest
import torch

from dufu.engine.host_reads import count_host_reads
from dufu.layers.moe import MoE, grouped_mm_available


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
    shared = {k: v for k, v in both.state_dict().items() if k.startswith("shared.")}
    both.load_state_dict({**routed.state_dict(), **shared})
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(both(x), routed(x) + both.shared(x.view(-1, 16)).view(2, 3, 16))


# ---------------------------------------------------------------------------------------- grouped GEMM vs loop
def _grouped_pair(hidden=32, ffn=48, **kwargs):
    """Two MoE layers with the same weights, one forced onto the grouped GEMM, one onto the per-expert loop."""
    torch.manual_seed(3)
    grouped = MoE(hidden, ffn, 4, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01, init_std=0.2, **kwargs)
    looped = MoE(hidden, ffn, 4, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01, init_std=0.2, **kwargs)
    looped.load_state_dict(grouped.state_dict())
    grouped.experts.grouped_mm, looped.experts.grouped_mm = True, False
    return grouped, looped


def _needs_grouped_mm(dtype=torch.float32):
    if not grouped_mm_available("cpu", dtype):
        pytest.skip(f"torch {torch.__version__} has no grouped GEMM for {dtype} on the CPU: the loop runs")


def _forward_backward(moe, x, dtype=None):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = moe(x)
    grad = torch.linspace(-1, 1, out.numel()).view_as(out)  # every output element weighted differently
    (out.float() * grad).sum().backward()
    return out, {"input": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


@pytest.mark.parametrize("hidden,ffn", [(32, 48), (30, 22)], ids=["aligned", "padded"])
def test_grouped_gemm_equals_the_loop_with_gradients(hidden, ffn):
    """fp32: the output and every gradient (tokens, router, experts) within 1e-5 relative, also where H and F are
    no multiple of 16 bytes and the grouped path pads them; one expert gets no token."""
    _needs_grouped_mm()
    grouped, looped = _grouped_pair(hidden, ffn, capacity_factor=None, shared_ffn_hidden_size=20)
    with torch.no_grad():
        for moe in (grouped, looped):
            moe.router.weight[3] = 0.0
            moe.router.weight[3, 0] = -10.0  # with x[..., 0] = 5, expert 3 loses every token: an empty group
    x = torch.randn(2, 9, hidden)
    x[..., 0] = 5.0
    out_g, grads_g = _forward_backward(grouped, x)
    out_l, grads_l = _forward_backward(looped, x)
    assert grouped.tokens_per_expert[3] == 0 and int(grouped.tokens_per_expert.sum()) == 36
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-6)
    for name, g in grads_l.items():
        assert g.abs().sum() > 0, name  # every gradient is there to compare (expert 3's rows are zero)
        torch.testing.assert_close(grads_g[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert grads_g["experts.gate_up_proj"][3].abs().max() == 0  # the empty expert gets no gradient


def test_grouped_gemm_in_bf16_autocast_is_the_loop_up_to_bf16_rounding():
    """Under CPU autocast both paths multiply in bf16 (the grouped one casts as F.linear would): outputs within
    a few bf16 units (2^-8) of each other, in bf16."""
    _needs_grouped_mm(torch.bfloat16)
    grouped, looped = _grouped_pair()
    x = torch.randn(2, 9, 32)
    out_g, grads_g = _forward_backward(grouped, x, torch.bfloat16)
    out_l, grads_l = _forward_backward(looped, x, torch.bfloat16)
    assert out_g.dtype == out_l.dtype == torch.bfloat16
    torch.testing.assert_close(out_g.float(), out_l.float(), rtol=2e-2, atol=2e-2)
    for name in ("input", "experts.gate_up_proj", "experts.down_proj"):
        torch.testing.assert_close(grads_g[name].float(), grads_l[name].float(), rtol=3e-2, atol=3e-2)


def test_the_grouped_forward_and_backward_read_nothing_on_the_host():
    """No tolist, item, int, float, bool or index of a tensor in the layer's forward and backward (on a GPU, each
    would wait for the device); the loop, the control, reads the counts once."""
    _needs_grouped_mm()
    grouped, looped = _grouped_pair()
    grouped.experts.grouped_mm = None  # the default choice, as every model builds it
    x = torch.randn(2, 9, 32)
    with count_host_reads() as grouped_reads:
        _, grads = _forward_backward(grouped, x)
    with count_host_reads() as looped_reads:
        _forward_backward(looped, x)
    assert grouped_reads.count == 0, grouped_reads.by_site
    assert looped_reads.count == 1 and "looped_swiglu" in next(iter(looped_reads.by_site)), looped_reads.by_site
    assert grads["experts.down_proj"].abs().sum() > 0 and grads["router.weight"].abs().sum() > 0


def test_grouped_mm_available_on_this_cpu_as_the_module_docstring_says():
    """torch 2.13's CPU kernel runs fp32 and bf16 eagerly; its meta kernel (torch.compile's) bf16 only."""
    if not hasattr(torch, "_grouped_mm"):
        assert not grouped_mm_available("cpu", torch.float32)
        return
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("the table of the module docstring was measured on torch 2.13")
    assert grouped_mm_available("cpu", torch.float32) and grouped_mm_available("cpu", torch.bfloat16)
    assert grouped_mm_available("cpu", torch.bfloat16, traced=True)
    assert not grouped_mm_available("cpu", torch.float32, traced=True)


def test_compiled_moe_layer_has_no_graph_break_in_bf16():
    """With the kernel probed (once per device and dtype, eagerly), torch.compile traces the layer's forward and
    backward as one graph: fullgraph=True refuses any graph break (the loop's tolist would be one)."""
    if not grouped_mm_available("cpu", torch.bfloat16, traced=True):
        pytest.skip("torch.compile cannot trace the grouped GEMM in bf16 on this torch")
    grouped, looped = _grouped_pair()
    grouped.experts.grouped_mm = None
    x = torch.randn(2, 9, 32)
    compiled = torch.compile(grouped, backend="aot_eager", fullgraph=True)
    out_c, _ = _forward_backward(compiled, x, torch.bfloat16)
    grads_c = {n: p.grad.clone() for n, p in grouped.named_parameters()}
    grouped.zero_grad()
    out_e, grads_e = _forward_backward(grouped, x, torch.bfloat16)
    torch.testing.assert_close(out_c, out_e)
    for name in ("experts.gate_up_proj", "experts.down_proj", "router.weight"):
        torch.testing.assert_close(grads_c[name], grads_e[name])
