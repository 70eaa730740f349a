"""Helpers shared by the parallel transforms."""

from __future__ import annotations

from torch import nn


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs of a model's transformer blocks: the children of every ModuleDict/ModuleList
    whose entries carry a ``layer_idx``."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleDict, nn.ModuleList)):
            children = list(module.named_children())
            if children and all(hasattr(c, "layer_idx") for _, c in children):
                found.extend((f"{name}.{n}" if name else n, c) for n, c in children)
    return found
