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
    embeddings) appear once. Each group is further split by tensor kind (plain tensor, or DTensor on a
    given mesh): fused and foreach optimizer kernels cannot mix the two, and under tensor parallelism a
    model has both (sharded matrices, replicated norms).
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
    for params, wd in ((decay, weight_decay), (no_decay_norm, weight_decay_norm), (no_decay_bias, weight_decay_bias)):
        by_kind: dict = {}
        for p in params:
            mesh = getattr(p, "device_mesh", None)
            by_kind.setdefault(id(mesh) if mesh is not None else None, []).append(p)
        for kind_params in by_kind.values():
            group = {"params": kind_params}
            if wd is not None:
                group["weight_decay"] = wd
            groups.append(group)
    # A part with nothing to train (a pipeline stage of a delta run whose delta sits on another stage) gets one
    # empty group: the optimizer and its schedule then exist and step over nothing, as on every other stage.
    return groups or [{"params": []}]
