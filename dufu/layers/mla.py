"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, sec. 2.1; DeepSeek-V3, sec. 2.1.1).

Keys and values come from one low-rank latent per token: ``c = RMSNorm(x W_dkv)`` of ``kv_lora_rank`` values,
expanded per head by ``kv_b_proj`` into a key part without position (``qk_nope_head_dim``) and a value
(``v_head_dim``). Position enters through a *decoupled* rotary key of ``qk_rope_head_dim`` values, computed from
x by the same down-projection and shared by all heads, concatenated to every head's key. Queries are low-rank
too (``q_lora_rank``: ``x -> q_a_proj -> RMSNorm -> q_b_proj``) or one plain projection (``q_lora_rank=None``,
DeepSeek-V2-Lite), each head's query a no-position part and a rotary part. The softmax scale is
``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN
rotary scaling (Peng et al. 2023), as transformers' ``DeepseekV3Attention``. ``rope_interleave`` says the
rotary features are stored in interleaved pairs (DeepSeek's checkpoints): they are de-interleaved before the
rotate-half rotation, which gives transformers' ``apply_rotary_pos_emb_interleave`` exactly.

**KV cache.** Generation caches the *compressed* latent and the rotated shared key, ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer, and expands them to keys and values at every step (the "naive"
form; absorbing ``kv_b_proj`` into the query and output projections would save that compute and is not done
here). For the DeepSeek-V3 671B recipe (128 heads, kv_lora_rank 512, rope 64, nope 128, v 128, 61 layers) that
is (512 + 64) x 2 bytes = 1,152 bytes per token and layer in bf16 (70,272 bytes = 68.6 KiB per token over 61
layers), against 128 x (192 + 128) x 2 = 81,920 bytes per layer (4.77 MiB per token) for standard multi-head
attention with the same heads: 71x less. The cache is dufu's :class:`~dufu.layers.attention.KVCache` (one entry
per module, 4-D tensors with the sequence in dim 2), so greedy and beam generation drive it unchanged (beam
search reorders dim 0).

**Tensor parallelism.** The per-head up-projections (``q_b_proj`` / ``q_proj`` and ``kv_b_proj``) are split by
heads (column parallel: each head's outputs are contiguous rows), ``out_proj`` is row parallel, as in
:class:`~dufu.layers.Attention`. The down-projections ``q_a_proj`` and ``kv_a_proj`` (with its rotary part) and
the latent norms are replicated: they are small (H x (q_lora_rank + kv_lora_rank + rope)) and every head needs
their whole output, so splitting them would only add a gather. Their gradients come back whole through the
column-parallel projections' input (summed over the ranks' heads there), except the shared rotary key, which
reaches the heads without a projection: its gradient is summed over the tensor-parallel ranks explicitly
(:func:`_sum_grad_over_heads`). Under sequence parallelism the input is gathered once (``tensor_parallel_input``).

**Context parallelism.** Each rank gathers the other ranks' *latents* (``kv_lora_rank + qk_rope_head_dim`` per
token, not the expanded keys and values of every head) and expands them itself; queries keep their global
positions (:class:`~dufu.parallel.context_parallel.ContextParallel`'s layout) and attend causally by them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from dufu.layers.attention import KVCache, context_parallel_of, padding_mask_to_bias
from dufu.layers.linear import Linear
from dufu.layers.rotary import RotaryEmbedding, apply_rotary


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context ``factor`` (Peng et al. 2023; DeepSeek's ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class LatentRotary(RotaryEmbedding):
    """The rotary tables of MLA's decoupled key/query part: dufu's :class:`RotaryEmbedding` plus YaRN
    (``rope_type="yarn"``: interpolated low frequencies blended into the original ones between
    ``beta_slow``/``beta_fast`` rotations, cos/sin times the YaRN attention factor), as transformers computes it."""

    def _inv_freq(self, device=None) -> torch.Tensor:
        s = self.rope_scaling
        if not (s and s.get("rope_type", s.get("type")) == "yarn"):
            return super()._inv_freq(device)
        dim, base, factor = self.head_dim, self.base, float(s["factor"])
        old_ctx = s.get("original_max_position_embeddings", self.max_position_embeddings)
        beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate

    @property
    def attention_factor(self) -> float:
        s = self.rope_scaling
        if not (s and s.get("rope_type", s.get("type")) == "yarn"):
            return 1.0
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor, mscale, mscale_all_dim = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        return yarn_mscale(factor)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32):
        cos, sin = super().forward(position_ids, torch.float32)
        a = self.attention_factor
        if a != 1.0:
            cos, sin = cos * a, sin * a
        return cos.to(dtype), sin.to(dtype)


class LatentNorm(nn.RMSNorm):
    """RMSNorm of a compressed latent, computed in fp32 and returned in the input's dtype (transformers'
    DeepseekV3RMSNorm does the same): under autocast the latent comes out of a low-precision matmul, and torch's
    fused RMSNorm takes no input whose dtype differs from its fp32 weight. Not dufu's sequence-parallel RMSNorm:
    the latent always spans the whole sequence here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).to(x.dtype)


def _sum_grad_over_heads(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Identity whose backward sums ``t``'s gradient over the tensor-parallel ranks when ``like`` (a parameter
    split by heads) is a DTensor: ``t`` is used by every head, each rank holds some heads, so each rank's gradient
    is a partial sum (Megatron's "f" operator). DTensor's own from_local/to_local(grad_placements) does the
    all-reduce; on one device (``like`` a plain tensor) nothing happens."""
    if not isinstance(like, DTensor):
        return t
    mesh = like.device_mesh
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class MLA(nn.Module):
    """Multi-head latent attention (see the module docstring), causal self-attention only."""

    # Under sequence parallelism, gather the sequence once here (the rotary angles need the whole sequence).
    tensor_parallel_input = "replicate"
    # A rank's ContextParallel when sequences are split (see context_parallel_of); the model may also pass it.
    context_parallel = None

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: Optional[int] = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        max_position_embeddings: int = 4096,
        rope_theta: float = 10000.0,
        rope_scaling: Optional[dict] = None,
        rope_interleave: bool = True,
        bias: bool = False,
        norm_eps: float = 1e-6,
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
    ):
        super().__init__()
        if qk_rope_head_dim % 2:
            raise ValueError(f"MLA: qk_rope_head_dim {qk_rope_head_dim} must be even (rotary pairs)")
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_interleave, self.attention_dropout = rope_interleave, attention_dropout
        if q_lora_rank is None:  # DeepSeek-V2-Lite: one plain query projection
            self.q_proj = Linear(hidden_size, num_heads * self.qk_head_dim, bias=False, parallel="col")
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            # replicated (parallel="data"): small, and every head needs its whole output (module docstring)
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias, parallel="data")
            self.q_a_norm = LatentNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False, parallel="col")
        self.kv_a_proj = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias, parallel="data")
        self.kv_a_norm = LatentNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False, parallel="col")
        self.out_proj = Linear(num_heads * v_head_dim, hidden_size, bias=bias, parallel="row")
        self.resid_dropout = nn.Dropout(dropout)
        self.rotary = LatentRotary(qk_rope_head_dim, max_position_embeddings, base=rope_theta,
                                   rope_scaling=rope_scaling)
        self.scale = self.qk_head_dim ** -0.5
        s = self.rotary.rope_scaling
        if s and s.get("mscale_all_dim"):
            self.scale *= yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes this layer's KV cache keeps per token: the latent and the shared rotary key."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype.itemsize

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...), (x1, x3, ...)
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)

    def _expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (B, nh_local, S, nope + rope) and values (B, nh_local, S, v) from the latent (B, 1, S, r) and the
        rotated shared key (B, 1, S, rope)."""
        B, _, S, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(B, S, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # (B, nh_local, S, nope|v)
        k_rot = _sum_grad_over_heads(k_rot, self.kv_b_proj.weight)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)  # (B, nh_local, S, nope+rope)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        context_parallel=None,
    ) -> torch.Tensor:
        """x (B, T, C). ``attention_mask``: a (B, T_k) padding mask (1 keep), an additive bias broadcastable to
        (B, nh, T, T_k), or a boolean mask (True = attend) that is the whole mask, causality included
        (:func:`~dufu.layers.attention.document_mask`), as :class:`~dufu.layers.Attention` takes them.
        ``position_ids`` (B|1, T): default ``past .. past + T - 1`` (past: the length in ``kv_cache``).
        ``context_parallel``: the rank's ContextParallel when the caller holds it (else the module's own)."""
        B, T, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(B, T, -1, self.qk_head_dim).transpose(1, 2)  # (B, nh_local, T, nope + rope)
        q_nope, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)  # (B, T, r|rope)
        latent = self.kv_a_norm(latent)[:, None]  # (B, 1, T, r)
        k_rot = k_rot[:, None]  # (B, 1, T, rope): one rotary key for all heads
        past = kv_cache.get(self) if kv_cache is not None else None
        if position_ids is None:
            start = 0 if past is None else past[0].shape[2]
            position_ids = torch.arange(start, start + T, device=x.device)[None]  # (1, T)
        cos, sin = self.rotary(position_ids, dtype=torch.float32)  # (B|1, 1, T, rope)
        q_rot, k_rot = self._rotate(q_rot, cos, sin), self._rotate(k_rot, cos, sin)
        q = torch.cat([q_nope, q_rot], dim=-1)  # (B, nh_local, T, nope + rope)
        cp = context_parallel if context_parallel is not None and context_parallel.active else context_parallel_of(self)
        if cp is not None:
            if kv_cache is not None:
                raise ValueError("context parallelism splits training sequences; generation runs with it paused")
            y = self._context_parallel_attention(cp, q, latent, k_rot, attention_mask)
        else:
            if kv_cache is not None:  # the compressed latent is what is kept (module docstring)
                latent, k_rot = kv_cache.update(self, latent, k_rot)  # (B, 1, T_past + T, r | rope)
            k, v = self._expand(latent, k_rot)
            y = self._attention(q, k, v, attention_mask)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh_local * v)
        return self.resid_dropout(self.out_proj(y))

    def _attention(self, q, k, v, attention_mask) -> torch.Tensor:
        """Causal SDPA of q (B, nh, T, d) over k (B, nh, T_k, d), v (B, nh, T_k, dv) with the mask rules of
        :class:`~dufu.layers.Attention` (a cache offsets the causal diagonal)."""
        T, T_k = q.shape[2], k.shape[2]
        bias, causal = None, True
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                bias = padding_mask_to_bias(attention_mask, q.dtype)  # (B, 1, 1, T_k)
            elif attention_mask.dtype == torch.bool:
                bias, causal = attention_mask, False  # the whole mask, causality included
            else:
                bias = attention_mask.to(q.dtype)
        if causal and (bias is not None or T != T_k):
            i = torch.arange(T, device=q.device)[:, None] + (T_k - T)
            j = torch.arange(T_k, device=q.device)[None, :]
            causal_bias = torch.zeros(T, T_k, dtype=q.dtype, device=q.device).masked_fill(
                j > i, torch.finfo(q.dtype).min)
            bias = causal_bias if bias is None else bias + causal_bias
            causal = False
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, is_causal=causal, scale=self.scale,
            dropout_p=self.attention_dropout if self.training else 0.0)  # (B, nh_local, T, v)

    def _context_parallel_attention(self, cp, q, latent, k_rot, attention_mask) -> torch.Tensor:
        """This rank's queries (B, nh, T/cp, d) over the whole sequence: the latents of every rank gathered (in
        sequence order, differentiable), expanded here, attended causally by the queries' global positions."""
        latent, k_rot = cp.gather_all((latent, k_rot), 2)  # (B, 1, T, r | rope)
        T = latent.shape[2]
        k, v = self._expand(latent, k_rot)
        qpos = cp.token_index(T, q.device)[:, None]  # (T/cp, 1) global positions of this rank's queries
        keep = torch.arange(T, device=q.device)[None, :] <= qpos  # (T/cp, T)
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("MLA under context parallelism takes a (B, T) padding mask only, got an attention "
                                 f"mask of shape {tuple(attention_mask.shape)}")
            keep = keep & cp.gather(attention_mask.detach(), 1).to(torch.bool)[:, None, None, :]  # (B, 1, T/cp, T)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, scale=self.scale,
            dropout_p=self.attention_dropout if self.training else 0.0)  # (B, nh_local, T/cp, v)
