"""The losses of every family, in one place.

Every language-model and classification head trains with the same cross entropy: logits ``(..., V)`` against
integer labels ``(...)``, positions labelled ``ignore_index`` left out, averaged over the rest, in fp32 (bf16
logits would lose the small differences that matter in a log-softmax). What differs between families is
only what the labels mean, and the model's data path prepares that:

* causal LM (GPT, LLaMA): labels already shifted, position t holds token t + 1 (``shift_labels``);
* seq2seq LM (T5): the decoder's labels as they are, position t predicts ``labels[:, t]``;
* masked LM (BERT): -100 everywhere but the masked positions;
* image / sequence classification: one label per example, logits ``(B, classes)``.

A model's ``pipeline_loss`` (what a pipeline's last stage computes from its output) is one of these.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy in fp32 of ``(..., V)`` logits (e.g. (B, T, V) or (B, V)) against ``(...)`` labels."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index)  # (N, V), (N,)


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' rule for sequence classification heads: one output is regression (MSE); integer labels
    are single-label classification (cross entropy); float labels with several outputs are multi-label (binary
    cross entropy per label)."""
    logits = logits.float()
    if logits.shape[-1] == 1:
        return F.mse_loss(logits.squeeze(-1), labels.float().view(-1))
    if labels.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.float())


# The names the families' heads are known by; the same function.
causal_lm_loss = seq2seq_lm_loss = masked_lm_loss = classification_loss = cross_entropy_loss


def next_token_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face causal-LM ``labels`` (B, T) (the input ids) -> the target of every position (B, T): position
    t predicts ``labels[:, t + 1]``, the last one nothing. The loss equals that of ``logits[:, :-1]`` against
    ``labels[:, 1:]`` and keeps the hidden states whole (a sequence-parallel shard cannot be sliced by position)."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


# ------------------------------------------------------------------ fused output projection + cross entropy
#
# The plain path computes the (B, T, V) logits, casts them to fp32 and takes the cross entropy: it holds
# B*T*V fp32 values (the log-softmax saved for backward) where the model itself holds B*T*C. The fused path
# (the idea of Liger-Kernel's FusedLinearCrossEntropy, torchtune's chunked output loss and Wijmans et al. 2024,
# "Cut Your Losses in Large-Vocabulary Language Models") projects and takes the loss a chunk of rows at a time,
# so only one (rows, V) block of logits exists at once.

# Rows per chunk (fused_chunk_size): as many as keep a chunk's fp32 logits within FUSED_CHUNK_VALUES values (a
# block the caches hold runs faster), but at least FUSED_MIN_CHUNK_ROWS, since every chunk reads the whole (V, C)
# weight and adds to its whole gradient. Chosen from benchmarks/results/fused_loss-*.md.
FUSED_CHUNK_VALUES = 1 << 22
FUSED_MIN_CHUNK_ROWS = 256


def fused_chunk_size(vocab_size: int) -> int:
    """The default rows per chunk of :func:`fused_linear_cross_entropy` for a (this rank's) vocabulary."""
    return max(FUSED_MIN_CHUNK_ROWS, FUSED_CHUNK_VALUES // max(1, vocab_size))


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, chunk_size: Optional[int] = None) -> torch.Tensor:
    """``cross_entropy_loss(hidden @ weight.T, labels)`` without the whole logits tensor: the same mean fp32
    cross entropy over the labels that are not ``ignore_index``, and the same gradients for ``hidden`` and
    ``weight`` (a tied weight accumulates them like any use of a shared parameter).

    hidden (..., C), labels (...), weight (V, C) (an output head without bias). The logits of a chunk are
    ``hidden @ weight.T`` in the compute dtype (autocast's, else the weight's), then fp32 for ``log_softmax`` and
    the target's entry, F.cross_entropy's own arithmetic. Rows whose label is ignored are left out before the
    projection (the label checks make this function synchronise with a GPU once per call).
    ``chunk_size``: rows per chunk; default :func:`fused_chunk_size`.

    Under tensor parallelism ``weight`` is the column-parallel head's vocabulary-sharded DTensor (``Shard(0)``
    on a 1-D mesh): each rank computes its shard's maximum, sum of exponentials and (where it holds it) target
    logit, and a sum / max over the mesh combines them (Megatron-LM's vocab-parallel cross entropy, Shoeybi et
    al. 2019); the gradient of ``hidden``, partial on each rank, is summed the same way. The reductions are
    DTensor redistributions (``Partial`` -> ``Replicate``) on the weight's own mesh. Under sequence parallelism
    ``hidden`` is this rank's shard of the sequence, (B, T/tp, C) against (B, T) labels: it is gathered first.

    Design: the gradients are computed in the forward, chunk by chunk (as Liger-Kernel does), and backward
    only scales them by ``grad_output``. Recomputing the logits in backward instead (as Cut Cross-Entropy does)
    would save the (V, C) fp32 weight gradient held between forward and backward, but costs a fourth
    (N, C) x (C, V) matmul on top of three: a third more head FLOPs, and on a CPU the head is matmul-bound.
    The head is the last module of the forward and the first of the backward, so the held gradients live
    only across the step's peak, where (V + N) * C fp32 values replace the plain path's N * V. Backward scales
    them in place: one backward per graph (a second one through a retained graph fails autograd's version
    check rather than scaling twice). Without autograd (``torch.no_grad``, or inputs that need no gradient)
    only the loss is computed."""
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"fused_linear_cross_entropy: hidden size {hidden.shape[-1]} != the weight's "
                         f"{weight.shape[-1]} (weight is (vocab, hidden))")
    if isinstance(hidden, DTensor):
        raise TypeError("fused_linear_cross_entropy: hidden must be a plain tensor (this rank's activations), "
                        "got a DTensor; pass hidden.to_local()")
    vocab_size = weight.shape[0]
    offset, reduce = 0, None
    if isinstance(weight, DTensor):
        hidden, weight, offset, reduce = _vocab_parallel(hidden, weight, labels)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} needs labels of shape "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}")
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (N, C), (N,)
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= vocab_size))
    if bad.any():
        raise ValueError(f"fused_linear_cross_entropy: label {int(labels[bad][0])} is outside the vocabulary "
                         f"[0, {vocab_size}) (and is not ignore_index {ignore_index})")
    count = valid.sum()
    if int(count) < labels.numel():  # ignored rows (padding, prompts) cost nothing; their gradient is 0
        rows = valid.nonzero().squeeze(1)
        hidden, labels = hidden[rows], labels[rows]  # (N_valid, C), (N_valid,)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if chunk_size is None:
        chunk_size = fused_chunk_size(weight.shape[0])
    elif chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, count, dtype, int(chunk_size), offset, reduce,
                                          needs_grad)


def _vocab_parallel(hidden, weight, labels):
    """This rank's (hidden gathered under sequence parallelism, local weight shard, vocabulary offset, reduce)."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"fused_linear_cross_entropy: a DTensor weight must be vocabulary-sharded (Shard(0)) "
                         f"on a 1-D mesh (the column-parallel head); got {tuple(weight.placements)} on a "
                         f"{mesh.ndim}-D mesh")
    tp, rank, vocab = mesh.size(), mesh.get_local_rank(), weight.shape[0]
    per = -(-vocab // tp)  # DTensor shards like torch.chunk: ceil(V / tp) rows per rank, the last ones fewer
    offset = min(rank * per, vocab)
    local = weight.to_local()  # autograd: its gradient comes back as the Shard(0) parameter's
    if local.shape[0] != min(per, vocab - offset):
        raise ValueError(f"fused_linear_cross_entropy: rank {rank} of {tp} holds {local.shape[0]} vocabulary rows, "
                         f"expected {min(per, vocab - offset)} of {vocab}")
    if hidden.shape[:-1] != labels.shape:
        # sequence parallelism: hidden is this rank's chunk of the sequence (dim 1); gather it, as the head's
        # ColwiseParallel input layout would. Backward keeps this rank's chunk of the (already summed) gradient.
        B, T = labels.shape if labels.dim() == 2 else (None, None)
        full = (B, T, hidden.shape[-1])
        chunk = min(-(-T // tp), max(0, T - rank * -(-T // tp))) if T is not None else None
        if hidden.dim() != 3 or labels.dim() != 2 or hidden.shape[0] != B or hidden.shape[1] != chunk:
            raise ValueError(f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} and labels "
                             f"{tuple(labels.shape)} are neither the same tokens nor this rank's sequence chunk "
                             f"of (B, T) labels under sequence parallelism over {tp} ranks")
        stride = (full[1] * full[2], full[2], 1)
        hidden = DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False, shape=full, stride=stride)
        hidden = hidden.redistribute(mesh, [Replicate()]).to_local()  # (B, T, C)

    def reduce(x: torch.Tensor, op: str) -> torch.Tensor:
        return DTensor.from_local(x, mesh, [Partial(op)], run_check=False).full_tensor()

    return hidden, local, offset, reduce


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """See :func:`fused_linear_cross_entropy`. Forward: loss and (if needed) both gradients; backward: scale."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, count, dtype, chunk_size, offset, reduce, needs_grad):
        # hidden (N, C) and labels (N,): only the rows whose label is not ignored; count: how many there are
        # over the whole batch (a tensor, 0 if none), whose mean the loss is.
        N, V = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(dtype, torch.float32)  # the loss's dtype: fp32 (fp64 for fp64 inputs)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes chosen explicitly below
            h, w = hidden.to(dtype), weight.to(dtype)  # (N, C), (V, C) in the compute dtype
            grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if needs_grad else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs_grad else None
            total = torch.zeros((), dtype=torch.float64, device=hidden.device)
            for start in range(0, N, chunk_size):
                end = min(start + chunk_size, N)
                h_c, target = h[start:end], labels[start:end] - offset  # (n, C), (n,)
                logits = (h_c @ w.t()).to(acc)  # (n, V) fp32, like the plain path's .float() of compute-dtype logits
                here = (target >= 0) & (target < V)  # this (shard of the) vocabulary holds the target
                index = torch.where(here, target, 0).unsqueeze(1)  # (n, 1)
                if reduce is None:
                    # one device: F.cross_entropy's own arithmetic, log_softmax then the target's entry
                    probs = torch.log_softmax(logits, dim=1)  # (n, V), exponentiated below
                    del logits
                    total -= probs.gather(1, index).sum()
                    if needs_grad:
                        probs.exp_()
                else:
                    # vocabulary shards: the row maximum and the sum of exponentials over all of them
                    target_logit = logits.gather(1, index).squeeze(1) * here  # (n,), 0 where another shard has it
                    row_max = reduce(logits.amax(dim=1), "max")  # (n,)
                    probs = logits.sub_(row_max.unsqueeze(1)).exp_()  # exp(z - max), in place: (n, V)
                    sums = reduce(torch.stack([probs.sum(dim=1), target_logit]), "sum")  # (2, n)
                    total += (row_max + sums[0].log() - sums[1]).sum()  # log-sum-exp - target logit
                    if needs_grad:
                        probs.mul_(sums[0].reciprocal().unsqueeze(1))
                if needs_grad:
                    # d(loss_i)/d(logits_i) = softmax_i - onehot(target_i); the 1/count comes after the matmuls,
                    # so fp16 gradients of order 1 do not underflow.
                    probs.scatter_add_(1, index, -here.to(acc).unsqueeze(1))
                    g = probs.to(dtype)  # (n, V)
                    if dtype == acc:
                        torch.mm(g, w, out=grad_h[start:end])  # (n, C)
                        grad_w.addmm_(g.t(), h_c)  # (V, C)
                    else:
                        grad_h[start:end] = g @ w
                        grad_w.add_(g.t() @ h_c)  # summed over chunks in fp32
            loss = (total / count).to(acc)  # 0 / 0 = nan when every label is ignored, as F.cross_entropy
            if needs_grad:
                scale = torch.where(count > 0, 1.0 / count.clamp(min=1), 0.0)  # zero gradients then, as F's
                if reduce is not None:
                    grad_h = reduce(grad_h, "sum")  # each vocabulary shard's part of it, summed
                grad_h.mul_(scale)
                grad_w.mul_(scale)
                ctx.save_for_backward(grad_h, grad_w)
            ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_h, grad_w = ctx.saved_tensors
        # The loss is a scalar: its gradients are the ones computed in forward times grad_output (in place:
        # each is used once).
        grad_h = grad_h.mul_(grad_output).to(ctx.dtypes[0])
        grad_w = grad_w.mul_(grad_output).to(ctx.dtypes[1])
        return grad_h, grad_w, None, None, None, None, None, None, None
