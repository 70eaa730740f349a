"""Multi-head attention on ``F.scaled_dot_product_attention``: one module for the families dufu ships.

Q, K and V are separate column-parallel projections (not one fused QKV
matrix) so that splitting their output features across tensor-parallel ranks
gives each rank whole heads. The number of heads is therefore never stored in
the forward pass: it is read from the (possibly sharded) tensor as
``local_features // head_dim``. Grouped-query attention (Ainslie et al. 2023)
keeps the ratio of query to key/value heads on every rank, so it shards the same
way (``num_key_value_heads`` must be divisible by the tensor-parallel size).

Options cover the families: causal or bidirectional, a padding mask, rotary
position embeddings (LLaMA), an additive position bias (T5, Swin), cross-attention
(T5 decoder), a custom softmax scale (T5 uses 1), a per-head RMSNorm of queries and
keys before the rotation (Qwen3, :class:`HeadRMSNorm`), and a key/value cache for
generation.

Packed samples and document masks have one interface, ``position_ids`` that restart
at every sample or document start (as transformers' flattening collator writes
them): :func:`document_mask` turns them into a block-causal mask, which the models
compute once per forward and give every block as its ``attention_mask``. A row whose
positions run on without a break (every batch that is not packed, and generation
with or without a cache) is one document and keeps the plain causal path bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dufu.layers.linear import Linear
from dufu.layers.norm import RMSNorm
from dufu.layers.rotary import RotaryEmbedding, apply_rotary


class KVCache:
    """Keys and values of earlier positions, per attention module, for incremental decoding."""

    def __init__(self):
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, owner: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(owner)
        if key in self._store:
            pk, pv = self._store[key]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)  # (B, nkv, T_past + T, hs)
        self._store[key] = (k, v)
        return k, v

    def get(self, owner: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return self._store.get(id(owner))

    def put(self, owner: nn.Module, k: torch.Tensor, v: torch.Tensor) -> None:
        self._store[id(owner)] = (k, v)

    def __len__(self) -> int:
        return len(self._store)


def padding_mask_to_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T_k) with 1 = attend, 0 = padding  ->  additive (B, 1, 1, T_k) bias."""
    keep = attention_mask.to(torch.bool)[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=attention_mask.device).masked_fill(~keep, torch.finfo(dtype).min)


def document_starts(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(starts, real) of rows of ``position_ids`` (B|1, T): ``starts`` True where a token starts a document (its
    position does not continue the previous real token's), ``real`` the padding mask ``attention_mask`` (B, T) as
    booleans (1 = token), or None without one. The one rule :func:`document_mask` and context parallelism's
    document numbers (:func:`dufu.parallel.context_parallel.document_numbers`) both read."""
    T = position_ids.shape[-1]
    if attention_mask is None:
        return F.pad(position_ids[:, 1:] != position_ids[:, :-1] + 1, (1, 0), value=True), None  # (B|1, T)
    if attention_mask.dim() != 2 or attention_mask.shape[-1] != T:
        raise ValueError(
            f"document masks from position_ids {tuple(position_ids.shape)} combine with a (B, {T}) padding mask "
            f"only, got attention_mask {tuple(attention_mask.shape)}; give the padding mask, or no position_ids."
        )
    real = attention_mask.to(torch.bool)  # (B, T)
    position_ids = position_ids.expand(real.shape[0], T)
    index = torch.arange(T, device=real.device).expand_as(real)
    last_real = torch.where(real, index, -1).cummax(-1).values  # (B, T): latest real token at or before t
    before = F.pad(last_real[:, :-1], (1, 0), value=-1)  # latest real token before t (-1: none)
    continued = position_ids.gather(-1, before.clamp(min=0)) + 1 == position_ids
    return real & ((before < 0) | ~continued), real  # (B, T)


def document_mask(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The attention mask of packed samples (or of the documents inside a pretraining sample), read from their
    ``position_ids`` (B|1, T): a token starts a new document wherever its position does not continue the
    previous real token's (``position_ids[t] != position_ids[t'] + 1``, t' the last token before t that is
    not padding), and attends only to earlier tokens of its own document (block-causal).

    Returns ``attention_mask`` unchanged when every row is one run of positions (its first token may start
    anywhere, e.g. at the length of a key/value cache, and padding in ``attention_mask`` breaks no run: a
    left-padded prompt is one document), so such batches take the plain causal path bit for bit. Otherwise a
    boolean (B|1, 1, T, T) mask, True where query t may attend to key s: s <= t, the same document, and s not
    padding in ``attention_mask`` (B, T) (1 = token). :class:`Attention` takes it as the whole mask (causality
    included). Its size grows as T^2 (T = 8192: 64 MiB per row), what a dense mask costs.

    Why SDPA with this boolean mask (benchmarks/packing.py; results/packing-2026-11-25.md, 2 AMD EPYC cores,
    forward + backward of (B, nh, T, hs) = (4, 4, 1024, 16) / (4, 12, 512, 64) / (1, 12, 2048, 64), three
    documents per row): FlexAttention's block mask skips the masked blocks and its forward is faster (15 / 68 /
    40 ms against SDPA's 77 / 84 / 426 ms), but torch 2.13 has no FlexAttention backward on the CPU
    (NotImplementedError), so it cannot train here; it also needs torch.compile (0.5-5 s for a first call) and
    a ``create_block_mask`` per batch (0.1-0.5 s). SDPA took the boolean mask as fast as an additive float mask
    built from it (144 / 422 / 952 ms against 145 / 411 / 1148 ms), in a quarter of the memory; either costs up
    to 1.8x plain causal SDPA (82 / 512 / 651 ms), which skips the upper triangle. On a GPU FlexAttention, with
    its backward, is the one to measure."""
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    T = position_ids.shape[-1]
    starts, real = document_starts(position_ids, attention_mask)
    if not bool((starts.sum(-1) <= 1).all()):  # at most the first token of each row starts a document
        doc = starts.long().cumsum(-1)  # (B|1, T): which document each token is in
        causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
        keep = (doc[:, :, None] == doc[:, None, :]) & causal  # (B|1, T, T)
        if real is not None:
            keep = keep & real[:, None, :]
        return keep[:, None]  # (B|1, 1, T, T)
    return attention_mask


def context_parallel_of(module: nn.Module):
    """The ``context_parallel`` an :class:`Attention` or a model declares (the rank's
    :class:`~dufu.parallel.context_parallel.ContextParallel`, set when a run splits sequences) when it is splitting
    sequences now (not paused), else None."""
    cp = module.context_parallel
    return cp if cp is not None and cp.active else None


class HeadRMSNorm(RMSNorm):
    """RMSNorm of each head's features: queries or keys (B, nh, T, hs) normalised over hs with one weight of hs
    shared by all heads (Qwen3's ``q_norm`` / ``k_norm``, applied before the rotary embedding).

    Under tensor parallelism a rank holds whole heads, ``nh / tp`` of them, along dim 1 (the column-parallel
    projections split by heads), and the weight is replicated: the norm itself needs no communication, but each
    rank's weight gradient is that of its own heads, so the group's gradients must be summed (transformers' plan
    calls this "replicated_with_grad_allreduce", Megatron-core all-reduces its qk-layernorm gradients over the
    tensor group). ``tensor_parallel_split_dim`` declares it: torch's ``SequenceParallel(sequence_dim=1)`` is exactly
    this style (replicated weight, input and output split along a dim, the weight gradient summed by DTensor), and
    dim 1 is the heads here, not the sequence. Under sequence parallelism the inherited ``sequence_parallel``
    declaration gets the same style."""

    tensor_parallel_split_dim = 1  # heads: (B, nh, T, hs)


class Attention(nn.Module):
    # Under sequence parallelism, gather the sequence once here, not in each of q/k/v.
    tensor_parallel_input = "replicate"
    # Set by dufu.parallel.context_parallel.apply_context_parallel: then this rank holds chunks of the sequence
    # and fetches the other ranks' keys and values (see context_parallel_of).
    context_parallel = None

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        qkv_bias: bool = True,
        out_bias: bool = True,
        causal: bool = True,
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
        scale: Optional[float] = None,
        kv_input_size: Optional[int] = None,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
    ):
        super().__init__()
        num_key_value_heads = num_key_value_heads or num_heads
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
            head_dim = hidden_size // num_heads
        if num_heads % num_key_value_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_key_value_heads {num_key_value_heads}")
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.causal = causal
        self.scale = scale
        kv_in = kv_input_size or hidden_size
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=qkv_bias, parallel="col")
        self.k_proj = Linear(kv_in, num_key_value_heads * head_dim, bias=qkv_bias, parallel="col")
        self.v_proj = Linear(kv_in, num_key_value_heads * head_dim, bias=qkv_bias, parallel="col")
        self.out_proj = Linear(num_heads * head_dim, hidden_size, bias=out_bias, parallel="row")
        # Qwen3: each query and key head RMS-normalised over its features before the rotation
        self.q_norm = HeadRMSNorm(head_dim, eps=qk_norm_eps) if qk_norm else None
        self.k_norm = HeadRMSNorm(head_dim, eps=qk_norm_eps) if qk_norm else None
        self.attention_dropout = attention_dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary: Optional[RotaryEmbedding] = None,
        position_ids: Optional[torch.Tensor] = None,
        position_bias: Optional[torch.Tensor] = None,
        kv: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """x (B, T, C). ``attention_mask``: (B, T_k) padding mask (1 keep), an additive bias broadcastable
        to (B, nh, T, T_k), or a boolean mask broadcastable to it (True = attend) that is the whole mask, causality
        included (:func:`document_mask`). ``rotary``: the rotary embedding that turns q and k by the angles of
        ``position_ids`` (B|1, T); they default to ``past .. past + T - 1``, past being the length already in
        ``kv_cache``. The angles are taken here, where x holds the whole sequence: under sequence parallelism
        the caller holds only a shard of it (the input of this module is gathered, see
        ``tensor_parallel_input``). ``position_bias``: additive (1|B, nh_local, T, T_k). ``kv``: the sequence
        to attend to (cross-attention); its keys/values are computed once and cached when ``kv_cache`` is
        given."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh_local, T, hs)
        if self.q_norm is not None:
            q = self.q_norm(q)  # over hs, per head, before the rotation (Qwen3)
        if kv is not None and kv_cache is not None and kv_cache.get(self) is not None:
            k, v = kv_cache.get(self)  # cross-attention keys/values do not change while decoding
        else:
            src = x if kv is None else kv
            S = src.shape[1]
            k = self.k_proj(src).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, nkv_local, S, hs)
            v = self.v_proj(src).view(B, S, -1, self.head_dim).transpose(1, 2)
            if self.k_norm is not None:
                k = self.k_norm(k)  # (B, nkv_local, S, hs), before the rotation and the cache
            if rotary is not None and kv is None:
                if position_ids is None:
                    past = kv_cache.get(self) if kv_cache is not None else None
                    start = 0 if past is None else past[0].shape[2]
                    position_ids = torch.arange(start, start + T, device=x.device)[None]  # (1, T)
                cos, sin = rotary(position_ids, dtype=torch.float32)  # (B|1, 1, T, hs), fp32 as the reference
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            prefix = getattr(self, "delta_prefix", None)  # prefix tuning (dufu.delta.prefix)
            if prefix is not None and kv is None and (kv_cache is None or kv_cache.get(self) is None):
                pk, pv = prefix.expanded(B, k.dtype)
                k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
                n = pk.shape[2]
                if attention_mask is not None and attention_mask.dim() == 2:  # the prefix is never padding
                    attention_mask = F.pad(attention_mask, (n, 0), value=1)
                elif attention_mask is not None and attention_mask.dtype == torch.bool:  # every query sees it
                    attention_mask = F.pad(attention_mask, (n, 0), value=True)
                elif attention_mask is not None:
                    attention_mask = F.pad(attention_mask, (n, 0), value=0.0)
                if position_bias is not None:
                    position_bias = F.pad(position_bias, (n, 0), value=0.0)
            if kv_cache is not None:
                if kv is None:
                    k, v = kv_cache.update(self, k, v)
                else:
                    kv_cache.put(self, k, v)
        if rotary is not None and kv is not None:
            raise ValueError("rotary embeddings apply to self-attention only")
        cp = context_parallel_of(self)
        if cp is not None:
            if (kv is not None or kv_cache is not None or position_bias is not None
                    or getattr(self, "delta_prefix", None) is not None):
                raise ValueError("context parallelism splits plain self-attention only: not cross-attention, a "
                                 "key/value cache, a position bias or prefix tuning's prefix")
            y = cp.attention(q, k, v, attention_mask, causal=self.causal, scale=self.scale,
                             dropout_p=self.attention_dropout if self.training else 0.0,
                             enable_gqa=self.num_key_value_heads != self.num_heads)  # (B, nh_local, T/cp, hs)
            return self.resid_dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, -1)))
        T_k = k.shape[2]
        bias = None
        whole = False  # a boolean mask says everything, causality included
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                bias = padding_mask_to_bias(attention_mask, q.dtype)
            elif attention_mask.dtype == torch.bool:
                if attention_mask.shape[-1] != T_k or attention_mask.shape[-2] not in (1, T):
                    raise ValueError(
                        f"the boolean attention mask is for {tuple(attention_mask.shape[-2:])} queries x keys, but "
                        f"this attention has {T} x {T_k}: tokens added to the sequence inside the model (prompt "
                        "tuning's virtual tokens) have no place in a packed or document mask; train them on unpacked "
                        "samples."
                    )
                bias, whole = attention_mask, True  # SDPA takes it as it is (see document_mask)
            else:
                bias = attention_mask
        if position_bias is not None:
            if bias is not None and bias.dtype == torch.bool:
                keep, bias = bias, torch.zeros(bias.shape, dtype=q.dtype, device=q.device)
                bias = bias.masked_fill(~keep, torch.finfo(q.dtype).min)  # additive, to add the position bias
            bias = position_bias if bias is None else bias + position_bias
        causal = self.causal and kv is None and not whole
        if causal and (bias is not None or T != T_k):
            # Causal with an offset (cached past keys) or combined with a bias: build the mask explicitly.
            i = torch.arange(T, device=q.device)[:, None] + (T_k - T)
            j = torch.arange(T_k, device=q.device)[None, :]
            causal_bias = torch.zeros(T, T_k, dtype=q.dtype, device=q.device).masked_fill(j > i, torch.finfo(q.dtype).min)
            bias = causal_bias if bias is None else bias + causal_bias
            causal = False
        if bias is not None and bias.dtype not in (q.dtype, torch.bool):
            bias = bias.to(q.dtype)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, is_causal=causal, scale=self.scale,
            dropout_p=self.attention_dropout if self.training else 0.0,
            enable_gqa=self.num_key_value_heads != self.num_heads,
        )  # (B, nh_local, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh_local * hs)
        return self.resid_dropout(self.out_proj(y))


class CausalSelfAttention(Attention):
    """GPT-style causal self-attention (biases on every projection)."""

    def __init__(self, hidden_size: int, num_heads: int, bias: bool = True, attention_dropout: float = 0.0,
                 dropout: float = 0.0, head_dim: Optional[int] = None):
        super().__init__(hidden_size, num_heads, head_dim=head_dim, qkv_bias=bias, out_bias=bias, causal=True,
                         attention_dropout=attention_dropout, dropout=dropout)
