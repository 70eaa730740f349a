"""Autoregressive sampling for causal language models: greedy, temperature, top-k, top-p, with a KV cache.

A model that accepts ``kv_cache=`` (dufu's GPT and LLaMA families) is run once over the prompt and then
one token per step, attending to the keys and values cached from earlier positions
(:class:`dufu.layers.KVCache`). Any other model that returns ``.logits`` is run on the whole sequence every
step. Both give the same tokens.

Batches of prompts of different lengths are left-padded, with ``attention_mask`` marking the real
tokens; positions then count real tokens only (``cumsum(mask) - 1``), as transformers' ``generate`` does.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from dufu.layers import KVCache


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick the next token ids (B,) from last-position logits (B, V). temperature 0 means greedy."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop tokens once the mass *before* them exceeds top_p (always keep the first)
        drop = (cum - sorted_logits.softmax(-1)) > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _last_logits(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    if hasattr(logits, "full_tensor"):  # vocabulary-sharded logits under tensor parallelism
        logits = logits.full_tensor()
    return logits[:, -1, :]  # (B, V)


def tensor_parallel_size(model) -> int:
    """Ranks along the "tensor" mesh axis that hold the model's DTensor parameters (1 if none)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            if "tensor" in names:
                return p.device_mesh.shape[names.index("tensor")]
    return 1


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position of every token counting real tokens only; padding gets 0 (it is never attended to)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, eos_id: Optional[int] = None,
             max_context: Optional[int] = None, generator: Optional[torch.Generator] = None,
             attention_mask: Optional[torch.Tensor] = None, use_cache: bool = True,
             pad_to_multiple: Optional[int] = None) -> torch.Tensor:
    """Extend ``input_ids`` (B, T) by up to ``max_new_tokens`` tokens; returns (B, T + new).

    ``temperature`` 0 is greedy decoding. ``eos_id``: a row that produced it is padded with it, and
    generation stops when every row has. ``max_context``: the model sees at most this many of the last
    tokens (past it the cache is rebuilt on the window every step). ``attention_mask`` (B, T): 1 for
    prompt tokens, 0 for left padding. ``use_cache=False`` runs the whole sequence every step.
    ``pad_to_multiple``: every forward gets a sequence length divisible by it, by masked padding on the
    left, because sequence parallelism splits the sequence over the tensor-parallel ranks. Default: the
    tensor-parallel size of a model whose parameters are DTensors on a mesh with a "tensor" axis, else 1."""
    was_training = model.training
    model.eval()
    cached = use_cache and _accepts(model, "kv_cache")
    with_positions = _accepts(model, "position_ids")
    if pad_to_multiple is None:
        pad_to_multiple = tensor_parallel_size(model)
    B = input_ids.shape[0]
    ids = input_ids
    mask = attention_mask.to(torch.long) if attention_mask is not None else torch.ones_like(input_ids)
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    cache: Optional[KVCache] = None
    fed_mask = None  # (B, S): which of the S positions in `cache` are real tokens (padding may be cached too)
    consumed = window_start = 0  # tokens of `ids` in the cache; first token of the window
    for _ in range(max_new_tokens):
        start = 0 if max_context is None else max(0, ids.shape[1] - max_context)
        if cached and (cache is None or start != window_start):
            cache, fed_mask, consumed, window_start = KVCache(), mask[:, :0], start, start  # (re)fill the window
        first = consumed if cached else start
        new, new_mask = ids[:, first:], mask[:, first:]  # tokens the model has not seen yet
        pad = (-new.shape[1]) % pad_to_multiple
        if pad:
            new = torch.cat([new.new_zeros(B, pad), new], dim=1)
            new_mask = torch.cat([new_mask.new_zeros(B, pad), new_mask], dim=1)
        full_mask = torch.cat([fed_mask, new_mask], dim=1) if cached else new_mask  # (B, keys)
        kwargs = {"kv_cache": cache} if cached else {}
        if not bool(full_mask.all()):
            kwargs["attention_mask"] = full_mask
        if with_positions:  # real tokens count from 0 in the window; padding is never attended to
            kwargs["position_ids"] = _positions(full_mask)[:, -new.shape[1]:]
        logits = _last_logits(model(new, **kwargs))
        if cached:
            fed_mask, consumed = full_mask, ids.shape[1]
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    model.train(was_training)
    return ids
