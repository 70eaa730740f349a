"""Context parallelism: every rank of a context-parallel (cp) group holds ``T / cp`` tokens of each sample
through the whole model, and attention fetches the other ranks' keys and values.

Layout (load-balanced causal chunks, as Megatron-core and torchtitan): the sequence is cut into ``2 cp``
chunks of ``c = T / (2 cp)`` tokens and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``. Under a causal mask
chunk ``a`` attends to ``a + 1`` chunks of keys, so every rank attends to ``(r + 1) + (2 cp - r) = 2 cp + 1``
chunks: no rank idles on a mostly masked block. With T = 8, cp = 2 (chunks of 2)::

    tokens   0 1 | 2 3 | 4 5 | 6 7
    rank     0   | 1   | 1   | 0        rank 0 holds 0 1 6 7, rank 1 holds 2 3 4 5

Everything per token is split this way before the model sees it (:meth:`ContextParallel.shard_batch`: input
ids, labels, padding masks and the position ids of the whole sequence - the data's, restarting at each packed
document, or else the model's defaults - so learned and rotary positions are those of one device); everything
per sample or per weight is untouched. Parameters are the same on every cp rank; the gradients of the cp ranks'
tokens are averaged with data parallelism's (the trainer's data axis is dp x cp,
:class:`~dufu.parallel.parallel_dims.ParallelDims`), which with the trainer's loss weights is the gradient of
the mean over the global batch's targets.

Why an all-gather of K/V and not a ring (Megatron's ``--context-parallel-size`` passes K/V chunks around a ring,
overlapping each hop with a block of attention): Llama 3 trained to 128K tokens with this all-gather form
(Dubey et al. 2024, section 3.3.2); with grouped-query attention K and V are a small share of the activations,
the all-gather is one collective per tensor and layer that every backend has (its backward is a reduce-scatter,
gloo and NCCL alike), and the CPU and the GPU run the same algorithm. A ring's overlap pays where a GPU's
attention block takes longer than a hop, which this machine cannot measure.

All-to-all modes (``train.dist.context_parallel_mode``). ``"all_to_all"`` is DeepSpeed-Ulysses (Jacobs et al.
2023; Megatron's ``a2a``): inside attention an all-to-all over the cp group trades the sequence split for a head
split, q, k, v (B, nh, T/cp, hs) -> (B, nh/cp, T, hs), attention runs on whole sequences of this rank's heads
exactly as on one device, and a second all-to-all turns the output back. Per layer and direction a rank sends
(cp - 1) / cp of its q, k, v and output, (2 + 2 nkv/nh) (cp - 1) / cp times the bytes of its q, where the
all-gather mode receives the other ranks' K and V, 2 nkv/nh (cp - 1) times them: when the sequence grows with cp,
the all-to-all's volume per rank stays constant (Jacobs et al. 2023, section 3.2) and the all-gather's grows with
cp; at small cp with few key/value heads the all-gather moves less (cp 2, nkv/nh = 1/4: 0.5 against 1.25). Its
limit: cp ranks split the heads, so cp must divide the (tensor-parallel) rank's heads. ``"hierarchical"``
(Megatron's ``a2a+p2p``, with the all-gather in place of the ring) runs the all-to-all inside groups of
``context_parallel_a2a_size`` A neighbouring cp ranks (heads split A ways) and all-gathers K and V across the
cp / A groups; A need only divide the heads. The rank order the all-to-alls produce is the layout's, not the
sequence's: member j of a group sends and receives its chunks (j, 2 cp - 1 - j), so the received tokens are
put in sequence order by the same permutation as the all-gather's (:meth:`ContextParallel.global_order`) under
Ulysses, and hierarchical queries keep their chunks' ids (:meth:`ContextParallel.query_chunk_ids`) for the causal
mask. Grouped-query K and V whose heads A does not divide are repeated to lcm(nkv, A) heads before the all-to-all
(their gradients summed back), so every rank gets the K/V heads of its query heads.

Packed documents (``dataloader.train.packing``, ``document_mask``: position ids that restart at every document,
:mod:`dufu.data.packing`). On one device the model turns the breaks in its ``position_ids`` into a block-causal
mask (:func:`dufu.layers.attention.document_mask`): query t sees key s iff s <= t and doc(s) = doc(t). A rank
cannot find the breaks in its own tokens (a document may start exactly at a chunk's first token, or span the
chunks of other ranks), so :meth:`ContextParallel.shard_batch` numbers the documents on the whole (B, T) batch
before it splits anything (:func:`document_numbers`, the rule of ``document_mask``): the data's position ids
stay the model's positions (the rotary angles and learned positions of one device, relative to each document),
and the document numbers travel as the batch's ``attention_mask`` - the one per-token input that every model
hands unchanged to every attention layer and that a pipeline schedule splits into micro-batches with the rows.
Both are cut by the token index like the rest. A (B, T) ``attention_mask`` under context parallelism is so read
as document numbers: k >= 1 a token of document k of its row, -k a padding token inside document k, 0 a padding
token before any document; a 0/1 padding mask is the case of one document per row, with the numbers (and the
SDPA masks built from them) of before. Attention all-gathers the numbers with K and V and builds each query
chunk's (chunk x keys) mask as ``s <= t and doc(s) = |doc(t)| > 0`` (a padding query t sees its document's
keys, as with ``document_mask``), on SDPA's masked path in every mode (all-gather, Ulysses, hierarchical): the
mask-free kernel (:class:`_CausalChunks`) knows causality only. A batch whose rows are one document each keeps
its mask-free path, as ``document_mask`` keeps plain causal attention on one device. The targets need nothing:
``shift_labels`` are already each token's next-token id (a packed sample's last one its end-of-document token, the
padding's -100), so cut by the same index they stay with their tokens; no rank shifts anything.

Load balance with documents (tests/parallel/test_context_parallel.py::test_zig_zag_chunks_balance_packed_documents_
within_bounds). A token's causal work is now the number of keys before it in its own document, not its global
position, so the zig-zag chunks of the row no longer split it evenly. On llama_sft's packed rows (1024 tokens,
1-3 samples and a padding document) the busiest rank holds, against the mean, at cp 2 1.48 times at worst and
1.22 on average per row (1.21 over micro-batches of 2 rows), at cp 4 2.12 and 1.53; Megatron's THD layout,
each document cut into 2 cp zig-zag chunks of its own (padded to a multiple of 2 cp), would hold 1.01 and 1.03.
dufu keeps the zig-zag chunks of the row all the same, because that document work is what a kernel that skips
masked blocks does (FlexAttention, varlen FlashAttention), and no such kernel trains here: the masked SDPA that
runs computes every (chunk x keys up to its end) block, so every rank computes 2 cp + 1 chunk-blocks per head
and row whatever the documents - balanced exactly. A per-document (or striped) layout scatters each rank's
tokens over the whole row, so that path would have to compute its (T/cp x T) queries x keys in full, 2 cp / (cp +
1/2) times the zig-zag's blocks (1.6 at cp 2), and pad the batch. It is the step to take with a block-skipping
kernel on a GPU, where the 1.2-1.5 above is what it would win.

Kernels. Causal attention without a padding mask, bias or dropout (every decoder's training step) runs
mask-free on every device :func:`causal_kernel` names (:class:`_CausalChunks`): each query chunk ``a`` makes
two calls of a fused kernel that returns its log-sum-exp, one over the chunks before it (no mask) and one over
its own chunk (square, causal), merged by their log-sum-exps; the masked upper blocks are not computed and no
mask is built or kept for backward. The CPU takes ``_scaled_dot_product_flash_attention_for_cpu`` (proven here
against one device); CUDA takes FlashAttention (``_scaled_dot_product_flash_attention``, fp16/bf16) or the
memory-efficient kernel (``_scaled_dot_product_efficient_attention``, fp32, or where torch says this GPU cannot
run flash) - the same merge and backward code with other ops, unverified on a GPU here. Everything else (a
padding mask, a bias, attention dropout, other devices) takes the masked path: one ``scaled_dot_product_
attention`` per chunk over the keys up to its end with a (chunk x keys) mask, whose kernel then skips no block.

Overlap. A layer's K and V all-gathers are both issued before either is waited for (functional collectives
return an AsyncCollectiveTensor; the wait comes when the values are needed), and in backward the reduce-scatters
of dK and dV are both issued before either is waited for: on NCCL the two transfers queue back to back on the
communication stream. What does not overlap: the attention of a layer waits for its gathered K and V (it needs
every chunk before its own), and the next layer's all-gather cannot start early, because its K and V are
computed from this layer's output. Hiding the gather behind the rank's own diagonal blocks (which need only
local K and V) would change where their dK/dV are summed, and so the CPU's proven numbers; that is a ring's
territory and left out.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from dufu.layers.attention import Attention, document_starts
from dufu.parallel.context_kernels import _CausalChunks, _usable_on_this_gpu, causal_kernel
from dufu.models.base import contract_of
from dufu.torch_versions import has_single_functional_collectives

# torch 2.13 names the functional collectives ``all_gather_single``/``reduce_scatter_single`` and warns on the old
# ``*_tensor`` names, which torch 2.11 (the GPU machines') still has alone.
_all_gather = funcol.all_gather_single if has_single_functional_collectives() else funcol.all_gather_tensor
_reduce_scatter = (funcol.reduce_scatter_single if has_single_functional_collectives()
                   else funcol.reduce_scatter_tensor)
_all_to_all = funcol.all_to_all_single  # the same name in torch 2.11 and 2.13


class ContextParallel:
    """One rank's view of its context-parallel group: which tokens it holds, how to split a batch, and attention
    over the whole sequence. ``group``: the cp process group (None for a test of one rank's arithmetic with
    ``gather`` given); ``size``, ``rank``: cp and this rank's place in it; ``positions``: the model's
    ``default_position_ids(input_ids)`` (:func:`apply_context_parallel` sets it) or None for ``0 .. T-1``.
    ``a2a_size`` A: how many neighbouring cp ranks each all-to-all of heads spans (1: none, K/V all-gathered over
    the group; ``size``: Ulysses; between: hierarchical), ``a2a_group`` the A ranks of this rank's all-to-all
    (cp ranks ``rank // A x A ..`` + A - 1) and ``gather_group`` the size / A ranks (one per all-to-all group, at
    this rank's place in it) that all-gather K/V; both default to ``group`` where they are the whole group.
    ``all_to_all(x, group)``: a stand-in for the all-to-all along dim 0 (the planner's trace), as ``gather``."""

    def __init__(self, group, size: int, rank: int, positions: Optional[Callable] = None,
                 gather: Optional[Callable] = None, a2a_size: int = 1, a2a_group=None, gather_group=None,
                 all_to_all: Optional[Callable] = None):
        if a2a_size < 1 or size % a2a_size:
            raise ValueError(f"the all-to-all of heads spans a2a_size {a2a_size} ranks, which must divide the "
                             f"context-parallel size {size}")
        self.group, self.size, self.rank = group, size, rank
        self.positions = positions
        self._gather = gather  # tests: a stand-in for the all-gather
        self._all_to_all = all_to_all
        self.a2a_size = a2a_size
        self.a2a_group = group if a2a_group is None and a2a_size == size else a2a_group
        self.gather_group = group if gather_group is None and a2a_size == 1 else gather_group
        self.active = True
        # The device whose causal kernel attention takes (causal_kernel), None for the tensors' own; the planner's
        # trace of a GPU step, which runs on fake CPU tensors, sets the device it stands for.
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
        return torch.argsort(self.rank_order(T, device))

    def rank_order(self, T: int, device=None) -> torch.Tensor:
        """(T,) the position of each slot of the rank-ordered concatenation of every rank's tokens: the
        permutation that puts a whole sequence in that order (the inverse of :meth:`global_order`)."""
        return torch.cat([self.token_index(T, device, r) for r in range(self.size)])

    def query_chunk_ids(self) -> tuple[int, ...]:
        """The chunks whose queries this rank computes attention for: its own two, or under an all-to-all of
        heads those of every member of its all-to-all group, in member order (what the all-to-all returns)."""
        first = self.rank // self.a2a_size * self.a2a_size
        return tuple(a for r in range(first, first + self.a2a_size) for a in self.chunk_ids(r))

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
        """This rank's share of a batch: every (B, T, ...) tensor cut to the rank's tokens, and ``position_ids``:
        the data's (packed documents: restarting at each) or else the model's own default positions, computed on
        the whole sequence. Documents (position ids that restart inside a row) are numbered on the whole batch
        first and given as the ``attention_mask`` (:func:`document_numbers`; see the module docstring)."""
        ids = inputs.get("input_ids")
        if ids is None or ids.dim() != 2:
            raise ValueError("context parallelism splits token sequences: the batch has no (B, T) input_ids "
                             f"(keys: {sorted(inputs)}); train this data with train.dist.context_parallel_size=1")
        B, T = ids.shape
        labels = inputs.get("labels")
        if labels is not None and labels.dim() == 1:
            raise ValueError("context parallelism cannot split a sequence-classification batch (one label per "
                             "sample, read from a token only one rank holds); use train.dist.context_parallel_size=1")
        out = dict(inputs)
        positions = inputs.get("position_ids")
        if positions is not None:  # the data's: each packed sample or document counts from 0
            if positions.shape[-1] != T or positions.dim() > 2:
                raise ValueError(f"context parallelism takes position_ids of shape (B|1, {T}) beside input_ids "
                                 f"{tuple(ids.shape)}, got {tuple(positions.shape)}")
            mask = inputs.get("attention_mask")
            if mask is not None and tuple(mask.shape) != (B, T):
                raise ValueError(f"context parallelism combines position_ids with a ({B}, {T}) padding mask only, "
                                 f"got attention_mask {tuple(mask.shape)}")
            docs = document_numbers(positions.reshape(-1, T), mask)
            if docs is not None:  # (B|1, T), global: numbered before the split
                out["attention_mask"] = docs.expand(B, T)
        elif self.positions is not None:
            positions = self.positions(ids)
        else:
            positions = torch.arange(T, device=ids.device)[None]
        # (B, T); one row per sample, so a pipeline schedule splits it into micro-batches with the rest
        out["position_ids"] = positions.reshape(-1, T).expand(B, T)
        index = self.token_index(T, ids.device)
        for key, value in out.items():
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == T:
                out[key] = value.index_select(1, index)
        return out

    # ------------------------------------------------------------------------------------------------ attention
    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All ranks' tokens of ``x`` along ``dim``, in sequence order; differentiable (the backward sums each
        token's gradient from every rank's queries and returns it to the rank that holds it)."""
        return self.gather_all((x,), dim)[0]

    def gather_all(self, xs: tuple[torch.Tensor, ...], dim: int, group=None) -> tuple[torch.Tensor, ...]:
        """:meth:`gather` of several tensors of the same tokens (K and V): every all-gather is issued before any
        is waited for, and in backward every reduce-scatter before any is waited for. ``group``: the ranks to
        gather from (default the cp group), whose parts concatenate in cp rank order (the hierarchical mode's
        ``gather_group``: each part holds its all-to-all group's tokens, in member order)."""
        if self._gather is not None:
            parts = tuple(self._gather(x, dim) for x in xs)
        else:
            parts = _GatherSequence.apply(dim, self.group if group is None else group, *xs)
        order = self.global_order(parts[0].shape[dim], xs[0].device)
        return tuple(p.index_select(dim, order) for p in parts)

    def heads_for_sequence(self, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The all-to-all of the all-to-all group: each (B, H, T/cp, hs) of this rank's tokens becomes
        (B, H/A, A T/cp, hs), this rank's H/A heads (its place in the group) of every member's tokens, members in
        cp rank order. All are issued before any is waited for."""
        A = self.a2a_size
        sends = [x.unflatten(1, (A, -1)).transpose(0, 1) for x in xs]  # (A, B, H/A, Tl, hs): part j to member j
        got = self._exchange(sends)  # (A, B, H/A, Tl, hs): part j from member j
        return tuple(g.permute(1, 2, 0, 3, 4).flatten(2, 3) for g in got)

    def sequence_for_heads(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`heads_for_sequence`: (B, H/A, A T/cp, hs) -> (B, H, T/cp, hs)."""
        A = self.a2a_size
        send = y.unflatten(2, (A, -1)).permute(2, 0, 1, 3, 4)  # (A, B, H/A, Tl, hs): member j's tokens to j
        got = self._exchange([send])[0]  # (A, B, H/A, Tl, hs): head group j from member j
        return got.transpose(0, 1).flatten(1, 2)

    def _exchange(self, sends: list) -> tuple:
        if self._all_to_all is not None:
            return tuple(self._all_to_all(x, self.a2a_group) for x in sends)
        return _AllToAll.apply(self.a2a_group, *sends)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  causal: bool, scale: Optional[float], dropout_p: float, enable_gqa: bool) -> torch.Tensor:
        """Attention of this rank's queries q (B, nh, T/cp, hs) over the whole sequence, from this rank's keys and
        values (B, nkv, T/cp, hs); ``attention_mask``: this rank's part of a (B, T) padding mask (1 = token) or of
        an additive (B|1, 1|nh, 1, T) bias, or None. ``enable_gqa``: nkv < nh (read from the shapes here, which
        an all-to-all of heads changes). A (B, T) mask holds document numbers (packed documents, from
        :meth:`shard_batch`) or is a 0/1 padding mask (one document), :func:`document_numbers`."""
        A = self.a2a_size
        if A == 1:
            k, v = self.gather_all((k, v), 2)  # (B, nkv, T, hs)
            docs, bias = self._whole_mask(attention_mask, q.dtype)
            return self._chunked(q, k, v, docs, bias, causal, scale, dropout_p, self.chunk_ids())
        if q.shape[1] % A:
            raise ValueError(f"an all-to-all over {A} context-parallel ranks splits the {q.shape[1]} query heads of "
                             f"this rank {A} ways, which is not whole (dufu.parallel.checks refuses this at start-up)")
        m = math.lcm(k.shape[1], A)  # K/V heads every rank can take its share of, and that divide nh
        k, v = (t.repeat_interleave(m // t.shape[1], dim=1) if m != t.shape[1] else t for t in (k, v))
        q, k, v = self.heads_for_sequence((q, k, v))  # (B, nh/A, A T/cp, hs), (B, m/A, A T/cp, hs)
        docs, bias = self._whole_mask(attention_mask, q.dtype)
        if bias is not None and bias.shape[1] > 1:  # a bias per head: this rank's heads after the all-to-all
            bias = bias.unflatten(1, (A, -1))[:, self.rank % A]
        if A == self.size:  # Ulysses: whole sequences, put in sequence order, attended as on one device
            T = q.shape[2]
            order = self.global_order(T, q.device)
            q, k, v = (t.index_select(2, order) for t in (q, k, v))  # (B, h, T, hs)
            if causal and docs is None and bias is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p,
                                                   enable_gqa=q.shape[1] != k.shape[1])
            else:
                y = self._masked(q, k, v, docs, bias, causal, scale, dropout_p, (0,))
            y = y.index_select(2, self.rank_order(T, q.device))  # (B, nh/A, T, hs) in rank order
        else:  # hierarchical: the other groups' K/V gathered, the group's queries keep their chunks' ids
            k, v = self.gather_all((k, v), 2, group=self.gather_group)  # (B, m/A, T, hs)
            y = self._chunked(q, k, v, docs, bias, causal, scale, dropout_p, self.query_chunk_ids())
        return self.sequence_for_heads(y)  # (B, nh, T/cp, hs)

    def _whole_mask(self, attention_mask, dtype) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(docs, bias) of the whole sequence from this rank's part of a (B, T) mask of document numbers (a 0/1
        padding mask: one document, :func:`document_numbers`) or of an additive bias."""
        docs = bias = None
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                docs = self.gather(attention_mask.detach(), 1).long()  # (B, T) in sequence order
            elif attention_mask.dtype != torch.bool and attention_mask.shape[-2] == 1:
                bias = self.gather(attention_mask, attention_mask.dim() - 1).to(dtype)  # (B|1, 1|nh, 1, T)
            else:
                raise ValueError(f"context parallelism takes a (B, T) padding mask (or the document numbers its "
                                 f"shard_batch gives packed documents) or a (B, 1, 1, T) bias, got an attention mask "
                                 f"of shape {tuple(attention_mask.shape)} (a (B, 1, T, T) document mask is built by "
                                 "the attention itself under it; query-dependent biases are not supported)")
        return docs, bias

    def _chunked(self, q, k, v, docs, bias, causal: bool, scale, dropout_p: float, ids) -> torch.Tensor:
        """Attention of queries q (B, nh, n c, hs), the chunks ``ids`` (c tokens each) in that order, over the
        whole sequence's keys and values (B, nkv, T, hs) in sequence order; ``docs`` (B, T): the sequence's
        document numbers (or padding mask), or None."""
        kernel = None
        if causal and docs is None and bias is None and dropout_p == 0.0:
            kernel = causal_kernel(self.device_type or q.device.type, q.dtype)
        if kernel is not None and q.is_cuda:
            kernel = _usable_on_this_gpu(kernel, q, k, v)
        if kernel is not None:  # grouped-query K/V (fewer heads than q) are repeated inside, per call
            return _CausalChunks.apply(q, k, v, tuple(ids), scale, kernel)
        return self._masked(q, k, v, docs, bias, causal, scale, dropout_p, ids)

    @staticmethod
    def _masked(q, k, v, docs, bias, causal: bool, scale, dropout_p: float, ids) -> torch.Tensor:
        """:meth:`_chunked` with a (chunk x keys) mask per query chunk and SDPA (any mask, dropout, device); chunk
        ``a`` of c tokens sees the keys up to its end (of its document, :func:`document_keep`). One chunk of id 0
        is a whole sequence in order."""
        kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1])
        if not causal:  # bidirectional: every token of the row (a bidirectional model has no document masks)
            mask = (docs > 0)[:, None, None, :] if docs is not None else bias  # (B, 1, 1, T)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
        c, out = q.shape[2] // len(ids), []
        for j, a in enumerate(ids):
            end = (a + 1) * c  # chunk a sees keys 0 .. end-1 (the chunks before it and itself, causally)
            qi = torch.arange(a * c, end, device=q.device)[:, None]  # (c, 1) global query positions
            m = torch.arange(end, device=q.device)[None, :] <= qi  # (c, end): causal, bottom-right aligned
            if docs is not None:  # (B, 1, c, end): the same document, keys that are tokens
                m = m & document_keep(docs[:, None, a * c:end, None], docs[:, None, None, :end])
            mask = m if bias is None else torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~m, torch.finfo(q.dtype).min) + bias[..., :end]
            out.append(F.scaled_dot_product_attention(q[:, :, j * c:(j + 1) * c], k[:, :, :end], v[:, :, :end],
                                                      attn_mask=mask, **kw))  # (B, nh, c, hs)
        return torch.cat(out, dim=2)  # (B, nh, n c, hs)


# ---------------------------------------------------------------------------------------------------- documents
def document_numbers(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                     ) -> Optional[torch.Tensor]:
    """The documents of whole rows (B|1, T) as numbers, or None where every row is one document (one device then
    keeps plain causal attention, and so does context parallelism). The breaks are those of
    :func:`dufu.layers.attention.document_mask`: a token starts a document where its position does not continue
    the previous real token's (``attention_mask`` (B, T), 1 = token). Token t of document k (counted from 1 in its
    row) gets k, a padding token inside document k gets -k, padding before the first document 0; then query t may
    attend to key s iff s <= t and doc(s) = |doc(t)| > 0, which is ``document_mask``'s mask (a test holds the two
    equal). Written here rather than read from the (B, 1, T, T) mask ``document_mask`` returns: a rank needs the
    numbers of its own tokens, T of them per row, not a mask quadratic in T."""
    starts, real = document_starts(position_ids, attention_mask)
    if bool((starts.sum(-1) <= 1).all()):  # one document per row (its first token at most starts one)
        return None
    doc = starts.long().cumsum(-1)  # (B|1, T): 1, 2, .. in each row
    return doc if real is None else torch.where(real, doc, -doc)


def document_keep(docs_q: torch.Tensor, docs_k: torch.Tensor) -> torch.Tensor:
    """Which keys each query may see by their document numbers (:func:`document_numbers`; a 0/1 padding mask is
    one document): (B, 1, M, 1) queries' and (B, 1, 1, S) keys' numbers -> (B, 1, M, S), causality not included.
    A key must be a token (> 0); a token query sees its own document's, a padding query (-k) that of document k,
    and a padding query before any document (0) every token, as a padding mask alone lets it."""
    return (docs_k > 0) & ((docs_q.abs() == docs_k) | (docs_q == 0))


# ---------------------------------------------------------------------------------------------------- kernels
class _GatherSequence(torch.autograd.Function):
    """All-gather of each tensor of ``xs`` along ``dim`` (ranks' parts in rank order); backward: reduce-scatter of
    each gradient, so each rank gets the sum over all ranks' uses of its own part. Every collective is issued
    before the first is waited for: the all-gathers run along dim 0 (an un-waited AsyncCollectiveTensor; along
    another dim torch waits at once to reorder) and are reordered after the waits. Written as a Function around
    torch's functional collectives (not their autograd variant) so that selective activation checkpointing, which
    keeps the collectives' outputs (dufu.parallel.activation_checkpoint), replays the forward with the same saved
    tensors."""

    @staticmethod
    def forward(ctx, dim, group, *xs):
        ctx.dim, ctx.group = dim, group
        pending = [_all_gather(x.contiguous(), 0, group) for x in xs]  # (cp x ..., ...) each, in flight
        out = []
        for x, part in zip(xs, pending):
            part = _waited(part)
            out.append(torch.cat(torch.chunk(part, part.shape[0] // x.shape[0], dim=0), dim=dim) if dim else part)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        pending = [_reduce_scatter(g.contiguous(), "sum", ctx.dim, ctx.group) for g in grads]
        return (None, None, *(_waited(p) for p in pending))


class _AllToAll(torch.autograd.Function):
    """All-to-all of each tensor of ``xs`` over ``group`` along dim 0, in equal parts (part j to member j, the
    result's part j from member j); backward: the same all-to-all of each gradient, which returns every part to
    the member it came from. Every collective is issued before the first is waited for (q, k and v travel
    together). A Function around the functional collective rather than torch's ``all_to_all_single_autograd``
    for :class:`_GatherSequence`'s reason: selective activation checkpointing keeps the outputs of
    ``_c10d_functional`` ops and replays the forward with them, without communicating again."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        pending = [_all_to_all(x.contiguous(), None, None, group) for x in xs]  # all in flight
        return tuple(_waited(p) for p in pending)

    @staticmethod
    def backward(ctx, *grads):
        pending = [_all_to_all(g.contiguous(), None, None, ctx.group) for g in grads]
        return (None, *(_waited(p) for p in pending))


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
    ("pipeline", "samples", "context", "tensor") of the run's mesh (:meth:`ParallelDims.build_world`), and under
    the hierarchical mode the all-to-all and all-gather groups from its ("context_outer", "context_inner") view."""
    if not dims.cp_enabled:
        return None
    mesh, levels = world.context_mesh, world.context_levels_mesh
    groups = {}
    if levels is not None:
        groups = dict(a2a_group=levels.get_group("context_inner"), gather_group=levels.get_group("context_outer"))
    return ContextParallel(mesh.get_group("context"), dims.context_parallel_size, mesh.get_local_rank("context"),
                           a2a_size=dims.context_a2a_size, **groups)
