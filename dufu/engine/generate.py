"""Autoregressive sampling for causal language models: greedy, temperature, top-k, top-p."""

from __future__ import annotations

from typing import Optional

import torch


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


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, eos_id: Optional[int] = None,
             max_context: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Extend ``input_ids`` (B, T) by up to ``max_new_tokens`` tokens; returns (B, T + new)."""
    was_training = model.training
    model.eval()
    ids = input_ids
    done = torch.zeros(ids.size(0), dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        context = ids if max_context is None else ids[:, -max_context:]
        logits = model(context).logits
        if hasattr(logits, "full_tensor"):  # vocabulary-sharded logits under tensor parallelism
            logits = logits.full_tensor()
        logits = logits[:, -1, :]  # (B, V)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    model.train(was_training)
    return ids
