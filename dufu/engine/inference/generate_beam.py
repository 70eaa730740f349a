"""Beam search (transformers' ``generate(num_beams=K, do_sample=False)`` semantics, for one end-of-sequence id).

Every step, each prompt's K running beams are extended by every token; of the K * V candidates the 2K with
the highest summed log-probability are kept (with one end id at most K of them end, so K can always go on).
A candidate *ends* when it produced ``eos_id``, when its text hit a stop condition, or at the last step.

* The K best candidates that did not end become the next running beams.
* An ended candidate among the K best becomes a finished hypothesis, scored by its summed log-probability
  divided by ``generated_length ** length_penalty`` (the end token counts); each prompt keeps the K best.
* ``early_stopping``: ``True`` stops a prompt as soon as it has K finished hypotheses. ``False`` (the
  default) stops it once the best running beam, scored as if it ended at its current length, cannot beat
  the worst finished one; ``"never"`` with ``length_penalty > 0`` scores the running beam as if it ended at
  the maximum length (the exact bound for a positive penalty). A stopped prompt takes no new hypotheses.
* Generation ends when every prompt has stopped, or at ``max_new_tokens``. Each prompt returns its best
  finished hypothesis; shorter ones are filled with ``fill`` to the longest.

Written by hand because neither torch nor a library dufu depends on at run time has beam search over a
dufu model and its :class:`~dufu.layers.KVCache`. The model is driven through a "steps" object (see
:mod:`dufu.engine.inference.generate`): ``steps(ids, mask)`` -> next-token logits (R, V), and ``steps.reorder(rows)``
makes its state (cache, encoder output) follow the rows each new beam extends.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from dufu.engine.inference.generate_scores import apply_repetition_penalty

# A finite "impossible" score for empty slots and excluded candidates: unlike -inf it stays comparable
# (and free of NaN) through the sums and divisions of later steps.
IMPOSSIBLE = -1.0e9


@torch.no_grad()
def beam_search(steps, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, num_beams: int,
                eos_id: Optional[int] = None, fill: Optional[int] = None, length_penalty: float = 1.0,
                early_stopping: bool | str = False, repetition_penalty: float = 1.0,
                stop: Optional[Callable[[list[int]], bool]] = None) -> torch.Tensor:
    """The best sequence of each prompt in ``ids`` (B, T) (``mask`` (B, T): 1 = token, 0 = left padding):
    (B, T + n), n <= ``max_new_tokens`` being the longest best continuation."""
    B, T = ids.shape
    K = num_beams
    if max_new_tokens <= 0:
        return ids
    dev = ids.device
    filler = 0 if fill is None else fill  # without an end id or stop, every hypothesis has the full length
    batch = torch.arange(B, device=dev)[:, None]  # (B, 1)
    # Finished hypotheses, K slots per prompt, best first: tokens (padded with the filler), score, filled?
    fin_ids = ids.new_full((B, K, T + max_new_tokens), filler)
    fin_score = torch.full((B, K), IMPOSSIBLE, device=dev)
    fin_done = torch.zeros(B, K, dtype=torch.bool, device=dev)
    fin_len = torch.zeros(B, K, dtype=torch.long, device=dev)  # generated tokens, the end token included
    # Running beams: at first all K are the prompt, so only one of them may be extended.
    run_score = torch.zeros(B, K, device=dev)
    run_score[:, 1:] = IMPOSSIBLE
    is_open = torch.ones(B, dtype=torch.bool, device=dev)  # may the prompt still take new hypotheses?
    for t in range(max_new_tokens):
        logp = steps(ids, mask).log_softmax(-1)  # (R, V): R = B on the first step, B * K after
        if repetition_penalty != 1.0:
            logp = apply_repetition_penalty(logp, ids, repetition_penalty, mask)
        R, V = logp.shape
        rows_per_prompt = R // B
        # (B, 1 | K, V) + (B, K, 1): on the first step every beam reads the prompt's log-probabilities
        total = (logp.view(B, rows_per_prompt, V) + run_score[:, :, None]).view(B, K * V)  # (B, K * V)
        cand_score, flat = total.topk(2 * K, dim=-1)  # (B, 2K), best first
        token = flat % V
        src = batch * rows_per_prompt + (flat // V) % rows_per_prompt  # (B, 2K): the row each one extends
        cand_ids = torch.cat([ids[src], token[..., None]], dim=-1)  # (B, 2K, T + t + 1)

        ends = torch.full_like(token, t == max_new_tokens - 1, dtype=torch.bool)  # (B, 2K)
        if eos_id is not None:
            ends |= token == eos_id
        if stop is not None:
            for b, c in (~ends).nonzero().tolist():
                ends[b, c] = bool(stop(cand_ids[b, c, T:].tolist()))

        # The K best candidates that did not end go on (ended ones sink below every live one).
        run_score, pick = (cand_score + ends * IMPOSSIBLE).topk(K, dim=-1)  # (B, K)
        rows = src.gather(1, pick).flatten()  # (B * K,)
        ids = torch.cat([ids[rows], token.gather(1, pick).reshape(-1, 1)], dim=1)  # (B * K, T + t + 1)
        mask = torch.cat([mask[rows], mask.new_ones(B * K, 1)], dim=1)
        steps.reorder(rows)

        # Ended candidates among the K best become hypotheses, unless the prompt is closed or full.
        rank = torch.arange(2 * K, device=dev)[None, :]
        full = fin_done.all(-1, keepdim=True) & (early_stopping is True)  # (B, 1)
        takes = ends & (rank < K) & is_open[:, None] & ~full  # (B, 2K)
        new_score = (cand_score / (t + 1) ** length_penalty).masked_fill(~takes, IMPOSSIBLE)
        fin_score, best = torch.cat([fin_score, new_score], dim=1).topk(K, dim=-1)  # (B, K) of 3K
        fin_done = torch.cat([fin_done, takes], dim=1).gather(1, best)
        fin_len = torch.cat([fin_len, torch.full_like(takes, t + 1, dtype=torch.long)], dim=1).gather(1, best)
        cand_padded = cand_ids.new_full((B, 2 * K, fin_ids.shape[-1]), filler)
        cand_padded[..., :cand_ids.shape[-1]] = cand_ids
        fin_ids = torch.cat([fin_ids, cand_padded], dim=1)[batch, best]  # (B, K, T + max_new_tokens)

        # Close a prompt whose best running beam can no longer beat its worst hypothesis.
        length = max_new_tokens if (early_stopping == "never" and length_penalty > 0) else t + 1
        best_running = run_score[:, :1] / length ** length_penalty  # (B, 1)
        worst = torch.where(fin_done, fin_score.min(-1, keepdim=True).values, IMPOSSIBLE)  # (B, K)
        is_open &= (best_running > worst).any(-1)
        if not bool(is_open.any()) or (early_stopping is True and bool(fin_done.all())) or bool(ends.all()):
            break
    return fin_ids[:, 0, :T + int(fin_len[:, 0].max())]  # (B, T + n): each prompt's best hypothesis
