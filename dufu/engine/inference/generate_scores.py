"""Next-token scores to tokens, shared by sampling and beam search: CTRL's repetition penalty on the scores, and
the choice of the next token by greedy decoding or sampling (temperature, top-k, top-p)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


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


def apply_repetition_penalty(scores: torch.Tensor, ids: torch.Tensor, penalty: float,
                             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, section 4.1), as transformers applies it: the score of
    every token that occurs in ``ids`` (R, L) is divided by ``penalty`` when positive and multiplied by it when
    negative, so a penalty > 1 makes repeats less likely. ``scores`` (R, V): logits (greedy, sampling) or
    log-probabilities (beam search). With ``mask`` (R, L), padding (0) does not count as an occurrence.

    Written here rather than taken from transformers' logits processor: dufu does not depend on transformers
    at run time, and the padding of left-padded batches must not count (a row then penalizes what it would
    penalize alone)."""
    V = scores.shape[-1]
    ids = ids.clamp(max=V)  # ids past the head's vocabulary cannot be generated: they go to the spare column
    if mask is not None:
        ids = ids.masked_fill(mask == 0, V)
    padded = F.pad(scores, (0, 1))  # (R, V + 1): column V absorbs padding and out-of-vocabulary ids
    seen = padded.gather(1, ids)  # (R, L): the score of each occurring token (repeats read the same value)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return padded.scatter(1, ids, seen)[:, :V]
