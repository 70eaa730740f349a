"""Pre-LayerNorm transformer block (GPT-2 ordering: Radford et al. 2019)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dufu.layers.attention import CausalSelfAttention, KVCache
from dufu.layers.mlp import MLP
from dufu.layers.norm import LayerNorm


class TransformerLayer(nn.Module):
    """``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    ``layer_idx`` is the block's position in the model; pipeline parallelism
    places blocks on stages by it (LiBai's ``layer_idx``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_hidden_size: int,
        layer_idx: int,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        layernorm_epsilon: float = 1e-5,
        activation: str = "gelu_tanh",
        bias: bool = True,
        head_dim: Optional[int] = None,
    ):
        """``head_dim``: each head's size (default hidden_size // num_heads; a pruned model keeps its heads' size
        with fewer of them)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.ln1 = LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.attn = CausalSelfAttention(
            hidden_size, num_heads, bias=bias, attention_dropout=attention_dropout, dropout=dropout, head_dim=head_dim
        )
        self.ln2 = LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.mlp = MLP(hidden_size, ffn_hidden_size, activation=activation, bias=bias, dropout=dropout)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attention_mask=attention_mask, kv_cache=kv_cache)
        x = x + self.mlp(self.ln2(x))
        return x
