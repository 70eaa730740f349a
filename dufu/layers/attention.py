"""Multi-head causal self-attention on ``F.scaled_dot_product_attention``.

Q, K and V are separate column-parallel projections (not one fused QKV
matrix) so that splitting their output features across tensor-parallel ranks
gives each rank whole heads. The number of heads is therefore never stored in
the forward pass: it is read from the (possibly sharded) tensor as
``local_features // head_dim``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dufu.layers.linear import Linear


class CausalSelfAttention(nn.Module):
    # Under sequence parallelism, gather the sequence once here, not in each of q/k/v.
    tensor_parallel_input = "replicate"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        bias: bool = True,
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
    ):
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = Linear(hidden_size, hidden_size, bias=bias, parallel="col")
        self.k_proj = Linear(hidden_size, hidden_size, bias=bias, parallel="col")
        self.v_proj = Linear(hidden_size, hidden_size, bias=bias, parallel="col")
        self.out_proj = Linear(hidden_size, hidden_size, bias=bias, parallel="row")
        self.attention_dropout = attention_dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C_local) -> (B, nh_local, T, hs); nh_local = nh / tensor_parallel_size
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.attention_dropout if self.training else 0.0
        )  # (B, nh_local, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C_local)
        return self.resid_dropout(self.out_proj(y))
