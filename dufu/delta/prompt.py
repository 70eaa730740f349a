"""Prompt tuning (Lester et al. 2021): learned embeddings in front of the sequence, for decoder-only models.

The virtual tokens are a child of the first transformer block (``delta_prompt``): a forward pre-hook puts them
in front of the block's input, (B, T, C) -> (B, n + T, C), and widens a padding mask and explicit position ids
to match (the virtual tokens take positions 0..n-1, the sequence's move up by n, as in PEFT); a forward hook
on the last block takes them off again, so the final norm, the head and the loss see the T positions they
always do and no model code changes. Both hooks find what they need on the module they are called on, so
pipeline stages (the first block on the first stage, the last on the last) carry them with their blocks.
With a key/value cache (generation) the prompt goes in on the first call only, and the cache records how many
of its positions are virtual (learned position embeddings count the sequence's own positions from 0).

Decoder-only (causal) families only: an encoder's padding and its task heads read positions by index. Under
sequence parallelism a block's input is this rank's shard of the sequence: the hooks gather the sequence over
the tensor-parallel group (``sp_mesh``, set by :func:`dufu.parallel.tensor_parallel.apply_tensor_parallel`),
add or remove the prompt, and shard it again, so n + T must divide by the group's size. These are DTensor
redistributions, so the gradients flow back the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard


class PromptEmbedding(nn.Module):
    def __init__(self, num_virtual_tokens: int, hidden_size: int, std: float = 0.02, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_virtual_tokens, hidden_size, device=device))
        self.std = std

    @torch.no_grad()
    def init_own(self) -> None:
        nn.init.normal_(self.weight, std=self.std)

    def extra_repr(self) -> str:
        return f"num_virtual_tokens={self.weight.shape[0]}, hidden_size={self.weight.shape[1]}"


def _gathered(h: torch.Tensor, mesh) -> torch.Tensor:
    """The whole sequence from this rank's shard (B, T/tp, C) -> (B, T, C), differentiably."""
    return DTensor.from_local(h, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _sharded(h: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's shard of a whole sequence (B, T, C) -> (B, T/tp, C), differentiably."""
    if h.shape[1] % mesh.size():
        raise ValueError(f"prompt tuning under sequence parallelism: the sequence with its virtual tokens has "
                         f"{h.shape[1]} positions, which do not split over {mesh.size()} tensor-parallel ranks; "
                         f"choose num_virtual_tokens so that num_virtual_tokens + seq_length divides by "
                         f"{mesh.size()}")
    return DTensor.from_local(h, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


def _first_call(kv_cache) -> bool:
    return kv_cache is None or len(kv_cache) == 0


def _prepend(block: nn.Module, args: tuple, kwargs: dict):
    kv_cache = kwargs.get("kv_cache")
    if not _first_call(kv_cache):
        return None
    if kv_cache is not None:
        kv_cache.prompt_tokens = block.delta_prompt.weight.shape[0]  # the last block takes them off this call
        kv_cache.virtual_tokens = kv_cache.prompt_tokens  # cached positions that are not the sequence's
    h = args[0]
    mesh = getattr(block, "sp_mesh", None)
    if mesh is not None:
        h = _gathered(h, mesh)
    prompt = block.delta_prompt.weight.to(h.dtype)
    n = prompt.shape[0]
    h = torch.cat([prompt.unsqueeze(0).expand(h.shape[0], -1, -1), h], dim=1)  # (B, n + T, C)
    if mesh is not None:
        h = _sharded(h, mesh)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        kwargs["attention_mask"] = F.pad(mask, (n, 0), value=1)
    positions = kwargs.get("position_ids")
    if positions is not None:
        head = torch.arange(n, device=positions.device).expand(positions.shape[0], n)
        kwargs["position_ids"] = torch.cat([head, positions + n], dim=1)
    return (h, *args[1:]), kwargs


def _strip(block: nn.Module, args: tuple, kwargs: dict, output):
    kv_cache = kwargs.get("kv_cache")
    n = block.delta_prompt_tokens if kv_cache is None else getattr(kv_cache, "prompt_tokens", 0)
    if kv_cache is not None:
        kv_cache.prompt_tokens = 0  # later calls (one new token each) carry no prompt
    if not n:
        return output
    mesh = getattr(block, "sp_mesh", None)
    if mesh is None:
        return output[:, n:]
    return _sharded(_gathered(output, mesh)[:, n:], mesh)


def add_prompt(first_block: nn.Module, last_block: nn.Module, num_virtual_tokens: int, hidden_size: int):
    device = next(first_block.parameters()).device
    first_block.delta_prompt = PromptEmbedding(num_virtual_tokens, hidden_size, device=device)
    if device.type != "meta":
        first_block.delta_prompt.init_own()
    first_block.register_forward_pre_hook(_prepend, with_kwargs=True)
    last_block.delta_prompt_tokens = num_virtual_tokens
    last_block.register_forward_hook(_strip, with_kwargs=True)
    return first_block.delta_prompt
