"""Context parallelism in the traced step: one rank of ``cp`` is traced, its K/V all-gathers stood in for.

Under context parallelism (:mod:`dufu.parallel.context_parallel`) every rank runs the whole model on ``T / cp``
tokens of each sample, and each attention layer all-gathers K and V over the cp group (backward: a reduce-scatter
of their gradients). The planner traces that code itself rather than a formula of it: the fake model gets the
:class:`~dufu.parallel.context_parallel.ContextParallel` of rank 0, whose all-gather is stood in for by
:class:`_Gathered` (torch's functional all-gather and reduce-scatter ops on fake tensors, which allocate what the
real ones do), and the fake batch is cut by its own ``shard_batch``. So, as they run:

* every per-token tensor (embeddings, projections, MLP, norms, logits and the loss) has ``T / cp`` tokens;
* each attention layer holds the gathered K and V, (B, nkv, T, hs) in sequence order, kept by the chunks'
  attention for backward, and per local chunk ``a`` attention over the keys up to its end (c = T / (2 cp)): the
  FLOPs of (a + 1) of the 2 cp key chunks, the masked upper blocks not computed; without a mask on a CPU or a GPU
  (the mask-free fused kernels), as the run does;
* full activation checkpointing gathers again when it recomputes a block; selective checkpointing keeps the
  gathered K and V (the collectives' outputs) instead.

Rank 0 is traced: every rank attends to the same (r + 1) + (2 cp - r) = 2 cp + 1 chunks of keys (it holds
chunks r and 2 cp - 1 - r), so the work is the same, but rank 0's second chunk attends to the whole sequence: its
mask and attention temporaries are the largest, the worst rank's memory.

Under the all-to-all modes (``context_parallel_mode``) the same ContextParallel runs its all-to-alls of heads
(:class:`_Exchanged`: ``all_to_all_single`` on fake tensors): Ulysses attends whole sequences with ``1 / cp`` of the
heads, so the trace keeps what it keeps (no whole-sequence K/V of every head); the hierarchical mode exchanges heads
inside groups of A ranks and all-gathers K and V across the cp / A groups.

The recorder notes every collective as it is dispatched (:class:`KVGather`): once per forward, again when full
checkpointing recomputes a block, not when selective checkpointing replays the kept output; the reduce-scatters in
backward. :func:`dufu.plan.comm.cp_comm` prices them over the cp group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dufu.parallel.context_parallel import ContextParallel, apply_context_parallel


@dataclass
class KVGather:
    """One collective of the cp group as the traced step dispatched it: an all-gather (forward, or a checkpointed
    block's recomputation) or a reduce-scatter (backward), with the bytes of the whole-sequence tensor, (at
    micro-batch 1, per extra sample)."""

    part: int
    kind: str  # "all_gather" | "reduce_scatter" | "all_to_all"
    nbytes: tuple[float, float]  # all_to_all: the bytes of one rank's tensor (what it sends and receives)
    split: bool  # heads divided by tensor parallelism (K and V of column-parallel projections)
    backward: bool  # dispatched in the backward pass
    ranks: int = 0  # the ranks of the collective's group (0: the whole cp group)


# The ops of torch's functional collectives the stand-in dispatches (recorded by dufu.plan.recorder as they run).
COLLECTIVES = {"_c10d_functional.all_gather_into_tensor.default": "all_gather",
               "_c10d_functional.reduce_scatter_tensor.default": "reduce_scatter",
               "_c10d_functional.all_to_all_single.default": "all_to_all"}
# The process group name the fake collectives carry: fake tensors need no group behind it.
_GROUP = "dufu_plan_context"


class _Gathered(torch.autograd.Function):
    """Stands in for :mod:`dufu.parallel.context_parallel`'s all-gather along ``dim`` over ``cp`` ranks with the
    same functional collectives on fake tensors (the planner's process has no group; their fake kernels only need
    a name): forward, an all-gather (along dim 0, then moved to ``dim``, as ``all_gather_tensor`` does); backward,
    a reduce-scatter of the gradient. Being the collectives' own ops, selective checkpointing keeps their outputs
    and does not run them again, as in the real run (``SAVED_NAMESPACES`` of :mod:`dufu.parallel.
    activation_checkpoint`)."""

    @staticmethod
    def forward(ctx, x, dim: int, cp: int):
        ctx.dim, ctx.cp = dim, cp
        ops = torch.ops._c10d_functional
        out = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), cp, _GROUP))  # (cp x ..., ...)
        return torch.cat(torch.chunk(out, cp, dim=0), dim=dim) if dim else out  # (..., T, ...): rank order

    @staticmethod
    def backward(ctx, grad):
        ops = torch.ops._c10d_functional
        if ctx.dim:
            grad = torch.cat(torch.chunk(grad, ctx.cp, dim=ctx.dim))
        return ops.wait_tensor(ops.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.cp, _GROUP)), None, None


class _Exchanged(torch.autograd.Function):
    """Stands in for the all-to-all of heads of :mod:`dufu.parallel.context_parallel` (Ulysses, or the
    hierarchical mode's inside ``n`` ranks) with torch's functional ``all_to_all_single`` on fake tensors, along
    dim 0 (``n`` parts, one per member); backward, the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, n: int):
        ctx.n = n
        return _all_to_all(x, n)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.n), None


def _all_to_all(x: torch.Tensor, n: int) -> torch.Tensor:
    ops = torch.ops._c10d_functional
    splits = [x.shape[0] // n] * n
    return ops.wait_tensor(ops.all_to_all_single(x.contiguous(), splits, splits, _GROUP))


def split_for_context_parallel(model: nn.Module, inputs: dict, cp: int, device: str = "cpu",
                               a2a_size: int = 1) -> dict:
    """Give the fake ``model`` rank 0's ContextParallel of ``cp`` ranks with all-to-alls of heads over ``a2a_size``
    of them (1: none; ``cp``: Ulysses; between: hierarchical, whose K/V all-gather spans cp / a2a_size groups),
    its collectives stood in for (:class:`_Gathered`, :class:`_Exchanged`); return rank 0's share of the fake batch
    ``inputs``."""
    across = cp // a2a_size
    context = ContextParallel(None, cp, 0, gather=lambda x, dim: _Gathered.apply(x, dim, across), a2a_size=a2a_size,
                              all_to_all=lambda x, group: _Exchanged.apply(x, a2a_size))
    context.device_type = device  # the attention path of the device planned for (the fused kernel of the device planned for)
    apply_context_parallel(model, context)
    return context.shard_batch(inputs)
