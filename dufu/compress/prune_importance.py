"""Importance scores of attention heads and feed-forward neurons, one score per prunable unit of each block.

A unit is what pruning removes as a whole, and its weights are the rows it writes and the columns it reads:

* an attention unit is one key/value group: with multi-head attention (GPT, BERT) one head -- its ``head_dim``
  rows of Q, K and V and its ``head_dim`` columns of the output projection; with grouped-query attention
  (LLaMA, Ainslie et al. 2023) one key/value head together with the ``num_heads / num_key_value_heads`` query
  heads that read it, since a query head cannot outlive its key/value head;
* a feed-forward unit is one hidden neuron: its row of the up projection(s) (``fc1``, or ``gate_proj`` and
  ``up_proj`` of SwiGLU) and its column of the down projection (``fc2`` / ``down_proj``).

Two scores, both over the unit's weight matrices (biases are left out: the output bias stays, and an input bias
entry is one number beside a row of ``hidden_size``):

* ``magnitude``: the L2 norm of all of the unit's weights, ``sqrt(sum w^2)`` -- data-free;
* ``first-order``: the first-order Taylor estimate of the change of the loss when the unit's weights are
  zeroed, ``|sum_batches sum_w w * dL/dw|`` (Molchanov et al. 2019, "Importance Estimation for Neural Network
  Pruning"; summed over a coupled group of weights as LLM-Pruner does, Ma et al. 2023). Restricted to the
  output projection's columns it is Michel et al. 2019's head importance, the gradient of the loss with respect
  to a gate on the head's output.

No library computes these for dufu's modules (torch.nn.utils.prune scores single tensors, not heads coupled
across four projections, and only masks), so they are written here.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from dufu.compress.prune_families import mlp_projections
from dufu.errors import ConfigError

IMPORTANCE_KINDS = ("magnitude", "first-order")

# Maps a projection to a per-weight tensor of its shape (w^2, or w * dL/dw).
PerWeight = Callable[[nn.Linear], torch.Tensor]


def attention_unit_sums(attn: nn.Module, per_weight: PerWeight) -> torch.Tensor:
    """Sum of ``per_weight`` over each key/value group's rows and columns: (num_key_value_heads,)."""
    nkv, hs = attn.num_key_value_heads, attn.head_dim
    # A group's query heads are adjacent (query head h reads key/value head h // (nh / nkv), as SDPA's
    # enable_gqa and transformers' repeat_kv pair them), so its rows are one contiguous run of (nh / nkv) * hs.
    q = per_weight(attn.q_proj).sum(1).view(nkv, -1).sum(1)  # (nh * hs,) -> (nkv, nh / nkv * hs) -> (nkv,)
    k = per_weight(attn.k_proj).sum(1).view(nkv, hs).sum(1)  # (nkv * hs,) -> (nkv,)
    v = per_weight(attn.v_proj).sum(1).view(nkv, hs).sum(1)
    o = per_weight(attn.out_proj).sum(0).view(nkv, -1).sum(1)  # columns (nh * hs,) -> (nkv,)
    return q + k + v + o


def mlp_unit_sums(mlp: nn.Module, per_weight: PerWeight) -> torch.Tensor:
    """Sum of ``per_weight`` over each hidden neuron's rows and column: (ffn_hidden_size,)."""
    ins, out = mlp_projections(mlp)
    return sum(per_weight(p).sum(1) for p in ins) + per_weight(out).sum(0)  # (F,)


def unit_weights(model: nn.Module) -> list[nn.Parameter]:
    """Every weight matrix a unit of some block owns part of."""
    found = []
    for block in model.blocks.values():
        a = block.attn
        ins, out = mlp_projections(block.mlp)
        found += [m.weight for m in (a.q_proj, a.k_proj, a.v_proj, a.out_proj, *ins, out)]
    return found


@torch.no_grad()
def magnitude_scores(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """({block key: (nkv,)}, {block key: (F,)}): the L2 norm of each unit's weights."""
    def squares(p: nn.Linear) -> torch.Tensor:
        return p.weight.detach().float() ** 2

    heads = {k: attention_unit_sums(b.attn, squares).sqrt() for k, b in model.blocks.items()}
    neurons = {k: mlp_unit_sums(b.mlp, squares).sqrt() for k, b in model.blocks.items()}
    return heads, neurons


def _on_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def check_batches(batches: Optional[Iterable[dict]]) -> list[dict]:
    """The batches of first-order importance as a list; none, or something other than dicts, is a ConfigError."""
    if batches is None:
        raise ConfigError('importance="first-order" needs batches: a list of dicts of model inputs with labels '
                          '(e.g. {"input_ids": ..., "labels": ...}) whose loss the gradients come from. Give a few '
                          'batches of held-out data, or use importance="magnitude", which needs no data.')
    batches = list(batches)
    if not batches or not all(isinstance(b, dict) for b in batches):
        raise ConfigError(f"batches must be a non-empty list of dicts of model inputs with labels; got "
                          f"{len(batches)} item(s) of type(s) {sorted({type(b).__name__ for b in batches})}.")
    return batches


def first_order_scores(model: nn.Module, batches: Iterable[dict]) -> tuple[dict[str, torch.Tensor],
                                                                        dict[str, torch.Tensor]]:
    """({block key: (nkv,)}, {block key: (F,)}): ``|sum over batches and the unit's weights of w * dL/dw|``.

    The gradients are taken in eval mode (no dropout) with ``torch.autograd.grad``, so the model's own ``.grad``
    fields, ``requires_grad`` flags and train/eval mode are as they were afterwards."""
    batches = check_batches(batches)
    weights = unit_weights(model)
    flags, training = [w.requires_grad for w in weights], model.training
    device = weights[0].device
    totals = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
    model.eval()
    try:
        for w in weights:
            w.requires_grad_(True)
        with torch.enable_grad():
            for i, batch in enumerate(batches):
                loss = getattr(model(**_on_device(batch, device)), "loss", None)
                if loss is None:
                    raise ConfigError(f"batch {i} gave no loss: first-order importance needs labels in every batch "
                                      f"(keys given: {sorted(batch)}), e.g. labels or shift_labels for a language "
                                      "model, labels for a classifier.")
                for total, g in zip(totals, torch.autograd.grad(loss, weights)):
                    total += g.float()
    finally:
        for w, flag in zip(weights, flags):
            w.requires_grad_(flag)
        model.train(training)
    grads = {id(w): g for w, g in zip(weights, totals)}

    def taylor(p: nn.Linear) -> torch.Tensor:
        return p.weight.detach().float() * grads[id(p.weight)]

    with torch.no_grad():
        heads = {k: attention_unit_sums(b.attn, taylor).abs() for k, b in model.blocks.items()}
        neurons = {k: mlp_unit_sums(b.mlp, taylor).abs() for k, b in model.blocks.items()}
    return heads, neurons
