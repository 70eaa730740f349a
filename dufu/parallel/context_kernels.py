"""The fused attention kernels context parallelism runs a rank's causal chunks through, mask-free: each query chunk
makes two calls of a kernel that returns its log-sum-exp (one over the chunks before it, one over its own chunk,
square and causal), merged by their log-sum-exps; the masked upper blocks are not computed and no mask is built or
kept for backward. Which kernel each device and dtype takes, and why, is in :mod:`dufu.parallel.context_parallel`'s
docstring ("Kernels"); the chunk layout is :class:`dufu.parallel.context_parallel.ContextParallel`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

Op = Union[str, Callable]  # an aten op's name, or (tests) a stand-in with its signature


@dataclasses.dataclass(frozen=True)
class FusedAttention:
    """A fused attention kernel of torch that returns its log-sum-exp, and its backward: the two calls
    :class:`_CausalChunks` makes per query chunk. ``forward(q, k, v, causal, scale)`` gives the output
    (B, nh, M, hs), the log-sum-exp (B, nh, M) in fp32 and the kernel's state for its backward;
    ``backward(grad, q, k, v, out, lse, state, causal, scale)`` gives dq, dk, dv. Dropout is always 0.
    ``forward_op``/``backward_op``: names in ``torch.ops.aten``, or a test's stand-ins of the same signature."""

    name: str
    forward_op: Op
    backward_op: Op

    def op(self, which: Op) -> Callable:
        return getattr(torch.ops.aten, which) if isinstance(which, str) else which

    def forward(self, q, k, v, causal: bool, scale):
        o, lse = self.op(self.forward_op)(q, k, v, 0.0, causal, scale=scale)
        return o, lse, ()

    def backward(self, grad, q, k, v, out, lse, state, causal: bool, scale):
        return self.op(self.backward_op)(grad, q, k, v, out, lse, 0.0, causal, scale=scale)[:3]


class _CudaFlash(FusedAttention):
    """FlashAttention on CUDA: its backward takes the forward's sequence bookkeeping and RNG state back.
    Unverified here (no GPU); the arguments follow the ops' schemas in torch 2.11 and 2.13."""

    def forward(self, q, k, v, causal: bool, scale):
        o, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = self.op(self.forward_op)(
            q, k, v, 0.0, causal, False, scale=scale)
        return o, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, grad, q, k, v, out, lse, state, causal: bool, scale):
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return self.op(self.backward_op)(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed,
                                         offset, scale=scale)[:3]


class _CudaEfficient(FusedAttention):
    """The memory-efficient kernel on CUDA: its log-sum-exp rows are padded to a multiple of 32 (so cut to the
    queries for the merge and padded back for its backward). Unverified here (no GPU)."""

    def forward(self, q, k, v, causal: bool, scale):
        o, lse, seed, offset = self.op(self.forward_op)(q, k, v, None, True, 0.0, causal, scale=scale)
        return o, lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])

    def backward(self, grad, q, k, v, out, lse, state, causal: bool, scale):
        seed, offset, width = state
        lse = F.pad(lse, (0, width - lse.shape[-1])).contiguous()  # (B, nh, width): the forward's layout
        return self.op(self.backward_op)(grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False],
                                         causal, scale=scale)[:3]


CPU_FLASH = FusedAttention("cpu-flash", "_scaled_dot_product_flash_attention_for_cpu",
                           "_scaled_dot_product_flash_attention_for_cpu_backward")
CUDA_FLASH = _CudaFlash("cuda-flash", "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_flash_attention_backward")
CUDA_EFFICIENT = _CudaEfficient("cuda-efficient", "_scaled_dot_product_efficient_attention",
                                "_scaled_dot_product_efficient_attention_backward")


def causal_kernel(device_type: str, dtype: torch.dtype) -> Optional[FusedAttention]:
    """The fused kernel of mask-free causal attention on ``device_type`` for ``dtype``, or None (the masked path):

    =======  ====================  ===================================================================
    device   dtype                 kernel
    =======  ====================  ===================================================================
    cpu      any                   ``_scaled_dot_product_flash_attention_for_cpu`` (:data:`CPU_FLASH`)
    cuda     float16, bfloat16     ``_scaled_dot_product_flash_attention`` (:data:`CUDA_FLASH`)
    cuda     float32 (and others)  ``_scaled_dot_product_efficient_attention`` (:data:`CUDA_EFFICIENT`)
    other    any                   None
    =======  ====================  ===================================================================

    FlashAttention takes half precision only; fp32 on CUDA takes the memory-efficient kernel. On a real GPU
    :func:`_usable_on_this_gpu` may still step down (flash -> efficient -> masked) where torch says the inputs or
    the GPU do not suit a kernel."""
    if device_type == "cpu":
        return CPU_FLASH
    if device_type == "cuda":
        return CUDA_FLASH if dtype in (torch.float16, torch.bfloat16) else CUDA_EFFICIENT
    return None


def _usable_on_this_gpu(kernel: FusedAttention, q, k, v) -> Optional[FusedAttention]:
    """``kernel`` or the next one down that torch's own SDPA dispatch checks accept for these CUDA tensors (GPU
    generation, head size, dtype, kernels switched off with ``torch.backends.cuda.enable_*_sdp``), or None for the
    masked path. Unverified here (no GPU). The kernels see K and V repeated to the query heads (_CausalChunks), so
    the checks do too (a stride-0 view); the raw ops want a head size that is a multiple of 8, which SDPA pads to."""
    if q.shape[-1] % 8:
        return None
    k, v = (t[:, :1].expand(-1, q.shape[1], -1, -1) for t in (k, v))  # (B, nh, T, hs), no copy
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    if kernel is CUDA_FLASH and torch.backends.cuda.can_use_flash_attention(params):
        return kernel
    return CUDA_EFFICIENT if torch.backends.cuda.can_use_efficient_attention(params) else None


class _CausalChunks(torch.autograd.Function):
    """Causal attention of the rank's query chunks (chunk ids ``a``: its own two, or under the hierarchical mode
    its all-to-all group's 2 A) over the gathered keys, without a mask:
    each chunk attends to the keys before it (no mask) and to its own chunk (square, causal), two calls of a
    fused ``kernel`` (:class:`FusedAttention`) whose outputs merge by their log-sum-exps; the backward runs each
    call's kernel backward with the merged output and log-sum-exp, which gives each part's exact gradients (the
    merge of ring attention, Liu et al. 2023). Why: a (chunk x keys) mask, which SDPA would otherwise need for a
    causal mask not aligned to the top-left, is (2cp+1)(T/2cp)^2 values that each layer keeps for its backward
    (benchmarks/context_parallel.py measured them at 83% of a rank's saved activations at T = 16K), and the
    kernel then skips no masked block. The same code runs every device's kernel (:func:`causal_kernel`).
    Grouped-query K and V (nkv < nh heads) are saved as they are and repeated to nh heads for each kernel call,
    forward and backward (their gradients summed back over each group, as ``repeat_interleave``'s backward does):
    the repeated copies live during the forward and again during the backward, not in between."""

    @staticmethod
    def forward(ctx, q, k, v, chunk_ids, scale, kernel: FusedAttention):
        c = q.shape[2] // len(chunk_ids)
        kv = (k, v)  # (B, nkv, T, hs) as gathered: what is saved
        k, v = _repeated(k, q), _repeated(v, q)  # (B, nh, T, hs)
        outs, lses, states = [], [], []
        for j, a in enumerate(chunk_ids):
            qj = q[:, :, j * c:(j + 1) * c]
            o, lse, own = kernel.forward(qj, k[:, :, a * c:(a + 1) * c], v[:, :, a * c:(a + 1) * c], True, scale)
            past = None
            if a > 0:  # the chunks before: every key visible
                o_past, lse_past, past = kernel.forward(qj, k[:, :, :a * c], v[:, :, :a * c], False, scale)
                merged = torch.logaddexp(lse, lse_past)  # (B, nh, c), fp32 (fp64 for fp64)
                acc = torch.promote_types(q.dtype, torch.float32)  # half precision merges in fp32
                o = ((lse - merged).exp()[..., None] * o.to(acc)
                     + (lse_past - merged).exp()[..., None] * o_past.to(acc)).to(q.dtype)
                lse = merged
            outs.append(o)
            lses.append(lse)
            states.append((own, past))
        ctx.chunk_ids, ctx.scale, ctx.kernel, ctx.states = tuple(chunk_ids), scale, kernel, states
        ctx.save_for_backward(q, *kv, *outs, *lses)
        return torch.cat(outs, dim=2)  # (B, nh, n c, hs)

    @staticmethod
    def backward(ctx, grad):
        kernel, scale, n = ctx.kernel, ctx.scale, len(ctx.chunk_ids)
        q, k0, v0, *rest = ctx.saved_tensors
        outs, lses = rest[:n], rest[n:]
        c = q.shape[2] // n
        k, v = _repeated(k0, q), _repeated(v0, q)  # (B, nh, T, hs)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for j, (a, o, lse, (own_state, past_state)) in enumerate(zip(ctx.chunk_ids, outs, lses, ctx.states)):
            rows = slice(j * c, (j + 1) * c)
            g, qj = grad[:, :, rows].contiguous(), q[:, :, rows]
            own = slice(a * c, (a + 1) * c)
            gq, gk, gv = kernel.backward(g, qj, k[:, :, own], v[:, :, own], o, lse, own_state, True, scale)
            dq[:, :, rows] += gq
            dk[:, :, own] += gk
            dv[:, :, own] += gv
            if a > 0:
                past = slice(0, a * c)
                gq, gk, gv = kernel.backward(g, qj, k[:, :, past], v[:, :, past], o, lse, past_state, False, scale)
                dq[:, :, rows] += gq
                dk[:, :, past] += gk
                dv[:, :, past] += gv
        return dq, _summed(dk, k0), _summed(dv, v0), None, None, None


def _repeated(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped-query K or V (B, nkv, T, hs) repeated to q's nh heads (each K/V head serves nh / nkv queries)."""
    return t if t.shape[1] == q.shape[1] else t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _summed(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_repeated`: (B, nh, T, hs) summed over each group back to t's (B, nkv, T, hs)."""
    return grad if grad.shape[1] == t.shape[1] else grad.unflatten(1, (t.shape[1], -1)).sum(2)


# ---------------------------------------------------------------------------------------------------- gather
