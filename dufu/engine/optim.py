"""Optimizer parameter groups (LiBai's ``get_default_optimizer_params``)."""

from __future__ import annotations

from torch import nn


def get_default_optimizer_params(
    model: nn.Module,
    weight_decay: float | None = None,
    weight_decay_norm: float = 0.0,
    weight_decay_bias: float = 0.0,
) -> list[dict]:
    """Parameter groups: no weight decay on norms and biases (Loshchilov & Hutter 2019 practice).

    ``weight_decay=None`` keeps the optimizer's own ``weight_decay`` for the
    remaining (matrix and embedding) parameters. Shared parameters (tied
    embeddings) appear once.
    """
    norm_types = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)
    seen: set[int] = set()
    decay, no_decay_norm, no_decay_bias = [], [], []
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, norm_types):
                no_decay_norm.append(p)
            elif pname == "bias" or p.ndim < 2:
                no_decay_bias.append(p)
            else:
                decay.append(p)
    groups = []
    decay_group = {"params": decay}
    if weight_decay is not None:
        decay_group["weight_decay"] = weight_decay
    for group, wd in ((decay_group, None), ({"params": no_decay_norm}, weight_decay_norm), ({"params": no_decay_bias}, weight_decay_bias)):
        if not group["params"]:
            continue
        if wd is not None:
            group["weight_decay"] = wd
        groups.append(group)
    return groups
