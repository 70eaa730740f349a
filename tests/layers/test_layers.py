"""dufu.layers: parallel styles as data, and layer outputs checked against straightforward formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dufu.layers import (
    MLP,
    PARALLEL_STYLES,
    CausalSelfAttention,
    LayerNorm,
    Linear,
    PositionEmbedding,
    RMSNorm,
    TransformerLayer,
    VocabEmbedding,
)

B, T, C, NH = 2, 7, 32, 4


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("style", ["col", "row", "data"])
def test_linear_carries_its_parallel_style(style):
    layer = Linear(8, 16, parallel=style)
    assert layer.parallel == style
    assert f"parallel={style}" in repr(layer)
    assert isinstance(layer, torch.nn.Linear)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)


def test_linear_default_style_and_invalid_style():
    assert PARALLEL_STYLES == ("col", "row", "data")
    assert Linear(4, 4).parallel == "data"
    with pytest.raises(ValueError, match="'column'"):
        Linear(4, 4, parallel="column")


def test_layers_declare_their_styles():
    attn = CausalSelfAttention(C, NH)
    assert [attn.q_proj.parallel, attn.k_proj.parallel, attn.v_proj.parallel] == ["col"] * 3
    assert attn.out_proj.parallel == "row"
    mlp = MLP(C, 4 * C)
    assert (mlp.fc1.parallel, mlp.fc2.parallel) == ("col", "row")
    assert VocabEmbedding(10, C).parallel == "vocab"
    assert PositionEmbedding(10, C).parallel == "data"
    assert LayerNorm(C).sequence_parallel and RMSNorm(C).sequence_parallel


def manual_causal_attention(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Attention written out: per-head softmax(q k^T / sqrt(hs) + causal mask) v, heads concatenated."""
    Bx, Tx, Cx = x.shape
    hs = Cx // attn.num_heads
    q = x @ attn.q_proj.weight.T + attn.q_proj.bias
    k = x @ attn.k_proj.weight.T + attn.k_proj.bias
    v = x @ attn.v_proj.weight.T + attn.v_proj.bias
    out = torch.empty(Bx, Tx, Cx)
    for b in range(Bx):
        for h in range(attn.num_heads):
            cols = slice(h * hs, (h + 1) * hs)
            scores = q[b, :, cols] @ k[b, :, cols].T / math.sqrt(hs)  # (T, T)
            future = torch.triu(torch.ones(Tx, Tx, dtype=torch.bool), diagonal=1)
            weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            out[b, :, cols] = weights @ v[b, :, cols]
    return out @ attn.out_proj.weight.T + attn.out_proj.bias


def test_attention_equals_manual_causal_attention():
    attn = CausalSelfAttention(C, NH).eval()
    for p in attn.parameters():  # non-zero biases too, so every term is exercised
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(B, T, C)
    with torch.no_grad():
        y = attn(x)
        expected = manual_causal_attention(attn, x)
    assert y.shape == (B, T, C)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_attention_is_causal():
    attn = CausalSelfAttention(C, NH).eval()
    x = torch.randn(1, T, C)
    x2 = x.clone()
    x2[:, -1] += 1.0  # change only the last position
    with torch.no_grad():
        y, y2 = attn(x), attn(x2)
    torch.testing.assert_close(y[:, :-1], y2[:, :-1])  # earlier positions cannot see it
    assert not torch.allclose(y[:, -1], y2[:, -1])


def test_attention_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="not divisible"):
        CausalSelfAttention(30, 4)


def test_mlp_shape_and_formula():
    mlp = MLP(C, 3 * C, activation="gelu_tanh").eval()
    x = torch.randn(B, T, C)
    y = mlp(x)
    assert y.shape == (B, T, C)
    h = F.gelu(x @ mlp.fc1.weight.T + mlp.fc1.bias, approximate="tanh")
    torch.testing.assert_close(y, h @ mlp.fc2.weight.T + mlp.fc2.bias)
    with pytest.raises(ValueError, match="swish"):
        MLP(C, C, activation="swish")


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
def test_mlp_activations(activation):
    mlp = MLP(C, 2 * C, activation=activation, bias=False)
    assert mlp.fc1.bias is None and mlp.fc2.bias is None
    x = torch.randn(3, C)
    act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation]
    torch.testing.assert_close(mlp(x), act(x @ mlp.fc1.weight.T) @ mlp.fc2.weight.T)


def test_transformer_layer_is_pre_norm_residual():
    layer = TransformerLayer(C, NH, 4 * C, layer_idx=3).eval()
    assert layer.layer_idx == 3
    x = torch.randn(B, T, C)
    with torch.no_grad():
        y = layer(x)
        h = x + layer.attn(layer.ln1(x))
        expected = h + layer.mlp(layer.ln2(h))
    assert y.shape == (B, T, C)
    torch.testing.assert_close(y, expected)


def test_norms():
    x = torch.randn(B, T, C)
    ln = LayerNorm(C, eps=1e-5)
    torch.testing.assert_close(ln(x), (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5))
    rms = RMSNorm(C, eps=1e-6)
    torch.testing.assert_close(rms(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
