"""The losses of every family, in one place.

Every language-model and classification head trains with the same cross entropy: logits ``(..., V)`` against
integer labels ``(...)``, positions labelled ``ignore_index`` left out, averaged over the rest, in fp32 (bf16
logits would lose the small differences that matter in a log-softmax). What differs between families is
only what the labels mean, and the model's data path prepares that:

* causal LM (GPT, LLaMA): labels already shifted, position t holds token t + 1 (``shift_labels``);
* seq2seq LM (T5): the decoder's labels as they are, position t predicts ``labels[:, t]``;
* masked LM (BERT): -100 everywhere but the masked positions;
* image / sequence classification: one label per example, logits ``(B, classes)``.

A model's ``pipeline_loss`` (what a pipeline's last stage computes from its output) is one of these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy in fp32 of ``(..., V)`` logits (e.g. (B, T, V) or (B, V)) against ``(...)`` labels."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index)  # (N, V), (N,)


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' rule for sequence classification heads: one output is regression (MSE); integer labels
    are single-label classification (cross entropy); float labels with several outputs are multi-label (binary
    cross entropy per label)."""
    logits = logits.float()
    if logits.shape[-1] == 1:
        return F.mse_loss(logits.squeeze(-1), labels.float().view(-1))
    if labels.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.float())


# The names the families' heads are known by; the same function.
causal_lm_loss = seq2seq_lm_loss = masked_lm_loss = classification_loss = cross_entropy_loss
