"""Feed-forward block: column-parallel up projection, row-parallel down projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dufu.layers.linear import Linear

ACTIVATIONS = {
    "gelu": F.gelu,
    # GPT-2's "gelu_new": the tanh approximation of GELU (Hendrycks & Gimpel 2016).
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    # Under sequence parallelism, gather the sequence once before fc1.
    tensor_parallel_input = "replicate"

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "gelu_tanh",
        bias: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP(activation={activation!r}): expected one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.fc1 = Linear(hidden_size, ffn_hidden_size, bias=bias, parallel="col")
        self.fc2 = Linear(ffn_hidden_size, hidden_size, bias=bias, parallel="row")
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(ACTIVATIONS[self.activation](self.fc1(x))))


class GatedMLP(nn.Module):
    """Gated feed-forward (Shazeer 2020, "GLU Variants"): ``down(act(gate(x)) * up(x))``; SwiGLU with silu
    (LLaMA, Qwen2). gate/up are column-parallel, down row-parallel; ``tensor_parallel=False`` keeps all three
    replicated (the shared expert inside a replicated MoE layer)."""

    tensor_parallel_input = "replicate"

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "silu", bias: bool = False,
                 dropout: float = 0.0, tensor_parallel: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"GatedMLP(activation={activation!r}): expected one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        col, row = ("col", "row") if tensor_parallel else ("data", "data")
        self.gate_proj = Linear(hidden_size, ffn_hidden_size, bias=bias, parallel=col)
        self.up_proj = Linear(hidden_size, ffn_hidden_size, bias=bias, parallel=col)
        self.down_proj = Linear(ffn_hidden_size, hidden_size, bias=bias, parallel=row)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x)))
