"""Apply parallelism and memory/speed transforms to a single-device model, in one fixed order.

    1. tensor (+ sequence) parallelism   - from the style each dufu layer declares
    2. activation checkpointing          - per transformer block
    3. torch.compile                     - per transformer block
    4. FSDP2 / ZeRO                      - per block, then the root

(The order follows torchtitan: checkpointing and compile wrap the already
sharded blocks, and FSDP wraps last so its hooks see the final modules.)
"""

from __future__ import annotations

from torch import nn

from dufu.parallel.parallelize_utils import transformer_blocks


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


def parallelize(
    model: nn.Module,
    mesh=None,
    *,
    tensor_parallel: bool = False,
    sequence_parallel: bool = False,
    data_parallel: bool = False,
    zero_stage: int | None = None,
    activation_checkpoint: bool = False,
    compile: bool = False,
) -> nn.Module:
    """Apply, in this order: TP (+SP) on ``mesh["tensor"]``, activation checkpointing, compile, then
    data parallelism on ``mesh["data"]``: FSDP2 for ZeRO stages 1-3, ``replicate`` (DDP) without ZeRO.

    ``mesh`` is the stage's (data, tensor) DeviceMesh; it may be None on one process.
    """
    if tensor_parallel:
        from dufu.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tensor"], sequence_parallel=sequence_parallel)
    if activation_checkpoint:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    if data_parallel or zero_stage:
        from dufu.parallel.data_parallel import apply_fsdp, apply_replicate

        if zero_stage:
            apply_fsdp(model, mesh["data"], zero_stage)
        else:
            apply_replicate(model, mesh["data"])
    return model
