"""Bottleneck adapters (Houlsby et al. 2019; Pfeiffer et al. 2021): ``h + up(act(down(h)))`` on a sublayer's output.

An adapter is a child module (``delta_adapter``) of the sublayer it follows (a block's attention or MLP), and a
forward hook adds its output to the sublayer's, before the block's residual sum: Houlsby's placement puts one
after the attention and one after the MLP, Pfeiffer's only after the MLP. ``up`` starts at zero, so the model
starts as the base. No model code changes; the hook is a plain function that finds the adapter through the
module it is called on, so pipeline stage copies of a block carry their own.

Tensor parallelism: a sublayer's output is replicated over the tensor-parallel group (or, under sequence
parallelism, this rank's share of the tokens), so the adapter's weights are replicated. It holds them itself
(no child layers) and declares ``sequence_parallel``: under sequence parallelism torch's ``SequenceParallel``
style makes them replicated DTensors, so their gradients are summed over the group like a norm's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}


class BottleneckAdapter(nn.Module):
    sequence_parallel = True  # see the module docstring

    def __init__(self, hidden_size: int, bottleneck: int, activation: str = "relu", device=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"adapter activation {activation!r}: use one of {', '.join(_ACTIVATIONS)}")
        self.activation = activation
        factory = {"device": device}
        self.down_weight = nn.Parameter(torch.empty(bottleneck, hidden_size, **factory))
        self.down_bias = nn.Parameter(torch.empty(bottleneck, **factory))
        self.up_weight = nn.Parameter(torch.empty(hidden_size, bottleneck, **factory))
        self.up_bias = nn.Parameter(torch.empty(hidden_size, **factory))

    @torch.no_grad()
    def init_own(self) -> None:
        """down as ``nn.Linear``'s default, up and both biases zero: the adapter starts as the identity."""
        nn.init.kaiming_uniform_(self.down_weight, a=math.sqrt(5))
        nn.init.zeros_(self.down_bias)
        nn.init.zeros_(self.up_weight)
        nn.init.zeros_(self.up_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = _ACTIVATIONS[self.activation](F.linear(h, self.down_weight, self.down_bias))
        return F.linear(z, self.up_weight, self.up_bias)

    def extra_repr(self) -> str:
        return f"{self.up_weight.shape[0]} -> {self.down_weight.shape[0]} -> {self.up_weight.shape[0]}, {self.activation}"


def _add_adapter_output(module: nn.Module, args, output):
    if isinstance(output, tuple):
        return (output[0] + module.delta_adapter(output[0]),) + output[1:]
    return output + module.delta_adapter(output)


def add_adapter(module: nn.Module, hidden_size: int, bottleneck: int, activation: str) -> BottleneckAdapter:
    """Give ``module`` (any device incl. meta) an adapter on its output; returns the adapter."""
    if hasattr(module, "delta_adapter"):
        raise ValueError("it already has an adapter")
    device = next(module.parameters()).device if any(True for _ in module.parameters()) else None
    module.delta_adapter = BottleneckAdapter(hidden_size, bottleneck, activation, device=device)
    if device is None or device.type != "meta":
        module.delta_adapter.init_own()
    module.register_forward_hook(_add_adapter_output)
    return module.delta_adapter
