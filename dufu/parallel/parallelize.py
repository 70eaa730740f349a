"""Apply parallelism and memory/speed transforms to a single-device model, in one fixed order.

    1. tensor (+ sequence) parallelism   - from the style each dufu layer declares
       expert parallelism                - the experts of MoE layers over the expert axis (+ their data units)
       context parallelism               - every attention gets its rank's ContextParallel (sequence chunks)
    2. activation checkpointing          - per transformer block (dufu.parallel.activation_checkpoint)
    3. torch.compile                     - per transformer block (dufu.parallel.compile)
    4. FSDP2 / ZeRO                      - per block, then the root

(The order follows torchtitan: checkpointing and compile wrap the already
sharded blocks, and FSDP wraps last so its hooks see the final modules.)
"""

from __future__ import annotations

from torch import nn

from dufu.parallel.activation_checkpoint import apply_activation_checkpointing
from dufu.parallel.compile import apply_compile
from dufu.parallel.context_parallel import apply_context_parallel
from dufu.parallel.parallelize_utils import transformer_blocks


def parallelize(
    model: nn.Module,
    mesh=None,
    *,
    tensor_parallel: bool = False,
    sequence_parallel: bool = False,
    data_parallel: bool = False,
    zero_stage: int | None = None,
    activation_checkpoint: str | bool | None = None,
    compile: bool = False,
    expert_mesh=None,
    context_parallel=None,
    mp_policy=None,
    data_mesh=None,
) -> nn.Module:
    """Apply, in this order: TP (+SP) on ``mesh["tensor"]``, activation checkpointing, compile, then
    data parallelism on ``mesh["data"]``: FSDP2 for ZeRO stages 1-3, ``replicate`` (DDP) without ZeRO.

    ``activation_checkpoint``: None/False (off), "selective" or "full" (True: "full"), see
    :mod:`dufu.parallel.activation_checkpoint`.
    ``mesh`` is the stage's (data, tensor) DeviceMesh; it may be None on one process. ``expert_mesh``: the
    stage's ("expert_data", "expert") mesh under expert parallelism (:mod:`dufu.parallel.expert_parallel`),
    else None. ``context_parallel``: the rank's :class:`~dufu.parallel.context_parallel.ContextParallel`, or None.
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` for every data-parallel unit (the experts' too)
    (:func:`dufu.parallel.data_parallel.mixed_precision_policy`), None to gather and reduce in fp32.
    ``data_mesh``: under hybrid sharding the ("dp_replicate", "dp_shard") mesh ZeRO shards over in place of
    ``mesh["data"]`` (:attr:`dufu.parallel.parallel_dims.World.fsdp_mesh`), else None.
    """
    if tensor_parallel:
        # DTensor's and FSDP's modules (~1 s) load when a layout uses them, not with `import dufu.parallel`
        # (ParallelDims, the launch helpers); so below
        from dufu.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tensor"], sequence_parallel=sequence_parallel)
    if expert_mesh is not None:
        from dufu.parallel.expert_parallel import apply_expert_parallel  # DTensor (~1 s): only under EP

        apply_expert_parallel(model, expert_mesh["expert"])
    if context_parallel is not None:
        apply_context_parallel(model, context_parallel)
    if activation_checkpoint:
        mode = "full" if activation_checkpoint is True else activation_checkpoint
        if expert_mesh is not None and mode == "selective":
            # The experts' data-parallel unit sits inside the block, and FSDP2's hooks record profiler ranges
            # that torch 2.13's selective checkpointing cannot replay in the recomputation: blocks with a MoE
            # layer are checkpointed in full (the start-up summary says so: selective_checkpoint_notice).
            from dufu.parallel.expert_parallel import expert_modules  # DTensor (~1 s): only under EP

            blocks = transformer_blocks(model)
            moe = [(n, b) for n, b in blocks if expert_modules(b)]
            if moe:
                apply_activation_checkpointing(model, "full", blocks=lambda m: moe)
            mode_blocks = [(n, b) for n, b in blocks if not expert_modules(b)]
            if mode_blocks:
                apply_activation_checkpointing(model, mode, blocks=lambda m: mode_blocks)
        else:
            apply_activation_checkpointing(model, mode)
    if compile:
        apply_compile(model)
    if data_parallel or zero_stage:
        from dufu.parallel.data_parallel import apply_fsdp, apply_replicate  # FSDP (~1 s): only under DP/ZeRO

        if expert_mesh is not None:  # the experts' units first, on their own axis; the blocks' leave them out
            from dufu.parallel.expert_parallel import apply_expert_data_parallel  # DTensor: only under EP

            apply_expert_data_parallel(model, expert_mesh["expert_data"], zero_stage, mp_policy=mp_policy)
        if zero_stage:
            apply_fsdp(model, mesh["data"] if data_mesh is None else data_mesh, zero_stage, mp_policy=mp_policy)
        else:
            apply_replicate(model, mesh["data"], mp_policy=mp_policy)
    return model
