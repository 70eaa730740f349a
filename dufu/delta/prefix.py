"""Prefix tuning (Li & Liang 2021): learned keys and values in front of every self-attention's own.

Each targeted attention module gets a child ``delta_prefix`` holding ``key`` and ``value`` of shape
(key/value heads, num_virtual_tokens, head dim). :class:`dufu.layers.attention.Attention` puts them before the
keys and values of the sequence (after rotary angles: the prefix has no position, as PEFT's past key values) and
widens the padding mask, the position bias and the causal mask to match, so every token attends to the whole
prefix. With a key/value cache (generation) the prefix enters the cache once, on the first call.

Tensor parallelism: the attention's heads are split over the group (column-parallel k/v projections), so the
prefix is split by heads too (:class:`ShardHeads`); each rank uses its local heads, and their gradients need no
reduction. Initialisation: N(0, 1), the default of PEFT's prefix embedding without projection.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.parallel.style import distribute_module


class PrefixKV(nn.Module):
    tensor_parallel_heads = True  # see ShardHeads

    def __init__(self, num_heads: int, num_virtual_tokens: int, head_dim: int, device=None):
        super().__init__()
        self.key = nn.Parameter(torch.empty(num_heads, num_virtual_tokens, head_dim, device=device))
        self.value = nn.Parameter(torch.empty(num_heads, num_virtual_tokens, head_dim, device=device))

    @torch.no_grad()
    def init_own(self) -> None:
        nn.init.normal_(self.key)
        nn.init.normal_(self.value)

    def expanded(self, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, heads here, n, hs) keys and values in ``dtype``: this rank's heads under tensor parallelism."""
        k, v = (p.to_local() if isinstance(p, DTensor) else p for p in (self.key, self.value))
        return k.to(dtype).unsqueeze(0).expand(batch, -1, -1, -1), v.to(dtype).unsqueeze(0).expand(batch, -1, -1, -1)

    def extra_repr(self) -> str:
        h, n, d = self.key.shape
        return f"heads={h}, num_virtual_tokens={n}, head_dim={d}"


class ShardHeads(ParallelStyle):
    """Split a :class:`PrefixKV`'s tensors by heads (dim 0) over the tensor-parallel group, like the
    column-parallel key/value projections beside them; the forward is untouched (local heads)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for p_name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]),
                                                            requires_grad=p.requires_grad))
        return distribute_module(module, device_mesh, partition)


def add_prefix(attention: nn.Module, num_virtual_tokens: int) -> PrefixKV:
    """Give ``attention`` (a dufu Attention, any device incl. meta) a learned prefix; returns it."""
    device = attention.k_proj.weight.device
    attention.delta_prefix = PrefixKV(attention.num_key_value_heads, num_virtual_tokens, attention.head_dim, device)
    if device.type != "meta":
        attention.delta_prefix.init_own()
    return attention.delta_prefix
