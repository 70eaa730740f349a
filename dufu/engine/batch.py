"""Batches as the model takes them, and the tensors the loss bookkeeping counts and reduces."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def to_model_inputs(batch) -> dict:
    """A (B, T+1) token tensor becomes next-token inputs and already-shifted labels (``shift_labels``, as
    transformers names them); dict batches (e.g. masked-LM, classification, images) pass through."""
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch[:, :-1], "shift_labels": batch[:, 1:]}
    return dict(batch)


def count_loss_targets(inputs: dict) -> torch.Tensor:
    """How many targets a batch's loss averages over: labels that are not -100 (``shift_labels`` of causal
    LM data, ``labels`` of masked-LM / seq2seq / classification data), else one per sample."""
    target = inputs.get("shift_labels", inputs.get("labels"))
    if target is None:
        return torch.tensor(next(iter(inputs.values())).shape[0])
    return (target != -100).sum()


def local_scalar(t: torch.Tensor) -> torch.Tensor:
    """A detached fp32 plain tensor (losses are replicated DTensors under loss_parallel)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.float()
