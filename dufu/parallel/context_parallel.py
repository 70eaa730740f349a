"""Context parallelism: every rank of a context-parallel (cp) group holds ``T / cp`` tokens of each sample
through the whole model, and attention fetches the other ranks' keys and values.

Layout (load-balanced causal chunks, as Megatron-core and torchtitan): the sequence is cut into ``2 cp``
chunks of ``c = T / (2 cp)`` tokens and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``. Under a causal mask
chunk ``a`` attends to ``a + 1`` chunks of keys, so every rank attends to ``(r + 1) + (2 cp - r) = 2 cp + 1``
chunks: no rank idles on a mostly masked block. With T = 8, cp = 2 (chunks of 2)::

    tokens   0 1 | 2 3 | 4 5 | 6 7
    rank     0   | 1   | 1   | 0        rank 0 holds 0 1 6 7, rank 1 holds 2 3 4 5

Everything per token is split this way before the model sees it (:meth:`ContextParallel.shard_batch`: input
ids, labels, padding masks and the *global* position ids, so learned and rotary positions are those of one
device); everything per sample or per weight is untouched. Parameters are the same on every cp rank; the
gradients of the cp ranks' tokens are averaged with data parallelism's (the trainer's data axis is dp x cp,
:class:`~dufu.parallel.parallel_dims.ParallelDims`), which with the trainer's loss weights is the gradient of
the mean over the global batch's targets.

Why an all-gather of K/V and not a ring (Megatron's ``--context-parallel-size`` passes K/V chunks around a ring,
overlapping each hop with a block of attention): Llama 3 trained to 128K tokens with this all-gather form
(Dubey et al. 2024, section 3.3.2); with grouped-query attention K and V are a small share of the activations,
the all-gather is one collective per layer that every backend has (its backward is a reduce-scatter, gloo and
NCCL alike), and attention stays one ``scaled_dot_product_attention`` call per local chunk, so the CPU and the
GPU run the same algorithm on the same kernels. A ring needs each block's log-sum-exp to merge partial
softmaxes, which SDPA does not return on the CPU; its overlap pays where a GPU's attention block takes longer
than a hop, which this machine cannot measure. Each chunk attends only to the keys up to its end (``a + 1``
chunks), so the masked upper blocks are not computed at all.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_tensor, reduce_scatter_tensor

from dufu.layers.attention import Attention
from dufu.models.base import contract_of


class ContextParallel:
    """One rank's view of its context-parallel group: which tokens it holds, how to split a batch, and attention
    over the whole sequence. ``group``: the cp process group (None for a test of one rank's arithmetic with
    ``gather`` given); ``size``, ``rank``: cp and this rank's place in it; ``positions``: the model's
    ``default_position_ids(input_ids)`` (:func:`apply_context_parallel` sets it) or None for ``0 .. T-1``."""

    def __init__(self, group, size: int, rank: int, positions: Optional[Callable] = None,
                 gather: Optional[Callable] = None):
        self.group, self.size, self.rank = group, size, rank
        self.positions = positions
        self._gather = gather  # tests: a stand-in for the all-gather
        self.active = True
        # The mask-free causal kernel (_CausalChunks) where the device has it (the CPU); the planner's trace of a
        # GPU step, which runs on fake CPU tensors, sets the device it stands for.
        self.device_type: Optional[str] = None

    # ------------------------------------------------------------------------------------------------ layout
    def chunk_ids(self, rank: Optional[int] = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r, 2 * self.size - 1 - r

    def token_index(self, T: int, device=None, rank: Optional[int] = None) -> torch.Tensor:
        """The global positions (T / cp,) of the tokens ``rank`` holds, in the order it holds them."""
        if T % (2 * self.size):
            raise ValueError(f"context parallelism over {self.size} ranks needs a sequence length divisible by "
                             f"2 x {self.size} = {2 * self.size}, got {T}")
        c = T // (2 * self.size)
        return torch.cat([torch.arange(a * c, (a + 1) * c, device=device) for a in self.chunk_ids(rank)])

    def global_order(self, T: int, device=None) -> torch.Tensor:
        """The permutation that puts the rank-ordered concatenation of every rank's tokens in sequence order."""
        held = torch.cat([self.token_index(T, device, r) for r in range(self.size)])  # (T,) position of each slot
        return torch.argsort(held)

    @contextlib.contextmanager
    def paused(self):
        """Run the model on whole sequences (generation: every rank holds the same prompt)."""
        before, self.active = self.active, False
        try:
            yield
        finally:
            self.active = before

    # ------------------------------------------------------------------------------------------------ batches
    def shard_batch(self, inputs: dict) -> dict:
        """This rank's share of a batch: every (B, T, ...) tensor cut to the rank's tokens, and global
        ``position_ids`` added (the model's own default positions, computed on the whole sequence)."""
        ids = inputs.get("input_ids")
        if ids is None or ids.dim() != 2:
            raise ValueError("context parallelism splits token sequences: the batch has no (B, T) input_ids "
                             f"(keys: {sorted(inputs)}); train this data with train.dist.context_parallel_size=1")
        T = ids.shape[1]
        labels = inputs.get("labels")
        if labels is not None and labels.dim() == 1:
            raise ValueError("context parallelism cannot split a sequence-classification batch (one label per "
                             "sample, read from a token only one rank holds); use train.dist.context_parallel_size=1")
        if "position_ids" in inputs:
            raise ValueError("context parallelism takes no position_ids from the data (packed samples and document "
                             "masks are not supported with it): turn dataloader.train.packing and document_mask off")
        out = dict(inputs)
        positions = self.positions(ids) if self.positions is not None else torch.arange(T, device=ids.device)[None]
        # (B, T), global; one row per sample, so a pipeline schedule splits it into micro-batches with the rest
        out["position_ids"] = positions.expand(ids.shape[0], T)
        index = self.token_index(T, ids.device)
        for key, value in out.items():
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == T:
                out[key] = value.index_select(1, index)
        return out

    # ------------------------------------------------------------------------------------------------ attention
    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All ranks' tokens of ``x`` along ``dim``, in sequence order; differentiable (the backward sums each
        token's gradient from every rank's queries and returns it to the rank that holds the token)."""
        parts = self._gather(x, dim) if self._gather is not None else _GatherSequence.apply(x, dim, self.group)
        order = self.global_order(parts.shape[dim], x.device)
        return parts.index_select(dim, order)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  causal: bool, scale: Optional[float], dropout_p: float, enable_gqa: bool) -> torch.Tensor:
        """Attention of this rank's queries q (B, nh, T/cp, hs) over the whole sequence, from this rank's keys and
        values (B, nkv, T/cp, hs); ``attention_mask``: this rank's part of a (B, T) padding mask (1 = token) or of
        an additive (B|1, 1, 1, T) bias, or None."""
        k, v = self.gather(k, 2), self.gather(v, 2)  # (B, nkv, T, hs)
        Tl = q.shape[2]
        keep = bias = None
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                keep = self.gather(attention_mask.detach(), 1).to(torch.bool)[:, None, None, :]  # (B, 1, 1, T)
            elif attention_mask.dtype != torch.bool and attention_mask.shape[-2] == 1:
                bias = self.gather(attention_mask, attention_mask.dim() - 1).to(q.dtype)  # (B|1, 1|nh, 1, T)
            else:
                raise ValueError(f"context parallelism takes a (B, T) padding mask or a (B, 1, 1, T) bias, got an "
                                 f"attention mask of shape {tuple(attention_mask.shape)} (document masks and "
                                 "query-dependent biases are not supported with it)")
        kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa)
        if not causal:
            mask = keep if keep is not None else bias
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
        c, out = Tl // 2, []
        if keep is None and bias is None and dropout_p == 0.0 and (self.device_type or q.device.type) == "cpu":
            if enable_gqa and k.shape[1] != q.shape[1]:  # the kernel below takes as many K/V heads as queries
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            return _CausalChunks.apply(q, k, v, self.chunk_ids(), scale)
        for j, a in enumerate(self.chunk_ids()):
            end = (a + 1) * c  # chunk a sees keys 0 .. end-1 (the chunks before it and itself, causally)
            qi = torch.arange(a * c, end, device=q.device)[:, None]  # (c, 1) global query positions
            m = torch.arange(end, device=q.device)[None, :] <= qi  # (c, end): causal, bottom-right aligned
            if keep is not None:
                m = m & keep[..., :end]  # (B, 1, c, end)
            mask = m if bias is None else torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~m, torch.finfo(q.dtype).min) + bias[..., :end]
            out.append(F.scaled_dot_product_attention(q[:, :, j * c:(j + 1) * c], k[:, :, :end], v[:, :, :end],
                                                      attn_mask=mask, **kw))  # (B, nh, c, hs)
        return torch.cat(out, dim=2)  # (B, nh, T/cp, hs)


class _CausalChunks(torch.autograd.Function):
    """Causal attention of the rank's two query chunks (chunk ids ``a``) over the gathered keys, without a mask:
    each chunk attends to the keys before it (no mask) and to its own chunk (square, causal), two fused-kernel
    calls whose outputs merge by their log-sum-exps; the backward runs each call's kernel backward with the merged
    output and log-sum-exp, which gives each part's exact gradients (the merge of ring attention, Liu et al.
    2023). Why: a (chunk x keys) mask, which SDPA would otherwise need for a causal mask not aligned to the
    top-left, is (2cp+1)(T/2cp)^2 values that each layer keeps for its backward (benchmarks/context_parallel.py
    measured them at 83% of a rank's saved activations at T = 16K), and the kernel then skips no masked block.
    CPU only: torch's fused CPU kernel returns its log-sum-exp through ``_scaled_dot_product_flash_attention_for_cpu``;
    other devices take the masked path of :meth:`ContextParallel.attention`."""

    @staticmethod
    def forward(ctx, q, k, v, chunk_ids, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        c = q.shape[2] // 2
        outs, lses = [], []
        for j, a in enumerate(chunk_ids):
            qj = q[:, :, j * c:(j + 1) * c]
            o, lse = flash(qj, k[:, :, a * c:(a + 1) * c], v[:, :, a * c:(a + 1) * c], 0.0, True, scale=scale)
            if a > 0:  # the chunks before: every key visible
                o_past, lse_past = flash(qj, k[:, :, :a * c], v[:, :, :a * c], 0.0, False, scale=scale)
                merged = torch.logaddexp(lse, lse_past)  # (B, nh, c), fp32
                o = ((lse - merged).exp()[..., None] * o.float()
                     + (lse_past - merged).exp()[..., None] * o_past.float()).to(q.dtype)
                lse = merged
            outs.append(o)
            lses.append(lse)
        ctx.chunk_ids, ctx.scale = tuple(chunk_ids), scale
        ctx.save_for_backward(q, k, v, *outs, *lses)
        return torch.cat(outs, dim=2)  # (B, nh, 2c, hs)

    @staticmethod
    def backward(ctx, grad):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, o0, o1, lse0, lse1 = ctx.saved_tensors
        c = q.shape[2] // 2
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for j, (a, o, lse) in enumerate(zip(ctx.chunk_ids, (o0, o1), (lse0, lse1))):
            rows = slice(j * c, (j + 1) * c)
            g, qj = grad[:, :, rows].contiguous(), q[:, :, rows]
            own = slice(a * c, (a + 1) * c)
            gq, gk, gv = backward(g, qj, k[:, :, own], v[:, :, own], o, lse, 0.0, True, scale=ctx.scale)
            dq[:, :, rows] += gq
            dk[:, :, own] += gk
            dv[:, :, own] += gv
            if a > 0:
                past = slice(0, a * c)
                gq, gk, gv = backward(g, qj, k[:, :, past], v[:, :, past], o, lse, 0.0, False, scale=ctx.scale)
                dq[:, :, rows] += gq
                dk[:, :, past] += gk
                dv[:, :, past] += gv
        return dq, dk, dv, None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` (ranks' parts in rank order); backward: reduce-scatter of the gradient, so each
    rank gets the sum over all ranks' uses of its own part. Written as a Function around torch's functional
    collectives (not their autograd variant) so that selective activation checkpointing, which keeps the
    collectives' outputs (dufu.parallel.activation_checkpoint), replays the forward with the same saved tensors."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _waited(all_gather_tensor(x.contiguous(), dim, group))

    @staticmethod
    def backward(ctx, grad):
        return _waited(reduce_scatter_tensor(grad.contiguous(), "sum", ctx.dim, ctx.group)), None, None


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor (its AsyncCollectiveTensor waited for)."""
    return t.wait() if hasattr(t, "wait") else t


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Give every attention module of ``model`` (and the model itself, which then leaves the masks to them)
    the rank's :class:`ContextParallel`. The modules stay single-device code: they read the attribute."""
    model.context_parallel = cp
    # the batch's global positions are the model's own defaults (0 .. T-1; RoBERTa's skip padding); a pipeline
    # stage's part is of the model's class too
    cp.positions = contract_of(model).default_position_ids
    for module in model.modules():
        if isinstance(module, Attention):
            module.context_parallel = cp
    return model


def build_context_parallel(dims, world) -> Optional[ContextParallel]:
    """This rank's :class:`ContextParallel` when ``dims`` have cp > 1 (else None): its group from the context view
    ("pipeline", "samples", "context", "tensor") of the run's mesh (:meth:`ParallelDims.build_world`)."""
    if not dims.cp_enabled:
        return None
    mesh = world.context_mesh
    return ContextParallel(mesh.get_group("context"), dims.context_parallel_size, mesh.get_local_rank("context"))
