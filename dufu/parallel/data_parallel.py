"""Data parallelism and ZeRO on FSDP2.

=========================  ==================================================================
train config               what runs
=========================  ==================================================================
dp > 1, ZeRO off           ``replicate`` (DDP on the FSDP2 runtime): parameters replicated,
                           gradients all-reduced (averaged) after backward
ZeRO stage 1 and 2         ``fully_shard(reshard_after_forward=False)``: optimizer state and
                           gradients sharded (reduce-scatter), parameters gathered once per
                           step and kept until backward ends
ZeRO stage 3               ``fully_shard(reshard_after_forward=True)``: parameters also freed
                           after forward and gathered again for backward
=========================  ==================================================================

FSDP2 always reduce-scatters gradients, so ZeRO-1 (Rajbhandari et al. 2020,
sharded optimizer state only) is served by the stage-2 mechanism: the same
communication volume as DDP (reduce-scatter + all-gather = one all-reduce) and
no more memory than ZeRO-1. Each transformer block is its own FSDP unit so
gathers overlap compute; the root unit holds embeddings, final norm and head.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import fully_shard

from dufu.parallel.parallelize_utils import transformer_blocks


def apply_fsdp(model: nn.Module, dp_mesh, stage: int, mp_policy=None) -> nn.Module:
    reshard = stage >= 3
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": reshard}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for _, block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    # The root's parameters are used first (embedding) and last (head): never reshard them after
    # forward, as torchtitan does, since backward needs them again at once.
    kwargs["reshard_after_forward"] = False
    fully_shard(model, **kwargs)
    return model


def apply_replicate(model: nn.Module, dp_mesh) -> nn.Module:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for _, block in transformer_blocks(model):
        replicate(block, mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)
    return model
