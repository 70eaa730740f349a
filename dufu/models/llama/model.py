"""LLaMA-style decoder (Touvron et al. 2023; Llama 3, Qwen2, Qwen3), single-device code built from dufu.layers.

Pre-norm blocks ``x + attn(rmsnorm(x))`` then ``x + swiglu(rmsnorm(x))``, rotary position embeddings
(Su et al. 2021) in every attention, grouped-query attention (Ainslie et al. 2023), no biases except the
optional Q/K/V biases Qwen2 uses, optionally each query and key head RMS-normalised before the rotation
(Qwen3's ``qk_norm``; Yang et al. 2025, the Qwen3 technical report), and an output head that is separate or
tied to the token embedding.

Blocks live in a ``ModuleDict`` keyed by ``str(i)`` so parameter names (``blocks.3.attn.q_proj.weight``)
survive pipeline splitting. Each block's attention computes the rotary cos/sin tables from the positions: a
pipeline stage receives only hidden states, and under sequence parallelism only the attention sees the whole
sequence (the block's input is this rank's shard of it; the attention gathers it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dufu.layers import Attention, GatedMLP, KVCache, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding
from dufu.layers.attention import context_parallel_of, document_mask
from dufu.layers.loss import causal_lm_loss, fused_linear_cross_entropy, next_token_labels
from dufu.models.outputs import ModelOutput
from dufu.models.base import InitByModule


class LlamaBlock(nn.Module):
    """``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``; ``layer_idx`` places it on a pipeline stage.
    ``mlp`` replaces the SwiGLU feed-forward with another module (a mixture of experts, dufu.models.moe)."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        ffn_hidden_size: int,
        layer_idx: int,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        rope_scaling: Optional[dict] = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        mlp_bias: bool = False,
        attention_dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        qk_norm: bool = False,
        mlp: Optional[nn.Module] = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.attn = Attention(
            hidden_size, num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
            qkv_bias=qkv_bias, out_bias=out_bias, causal=True, attention_dropout=attention_dropout,
            dropout=hidden_dropout, qk_norm=qk_norm, qk_norm_eps=rms_norm_eps,
        )
        self.mlp_norm = RMSNorm(hidden_size, eps=rms_norm_eps)
        # ``mlp``: another feed-forward in its place (dufu.models.moe: a mixture of experts)
        self.mlp = mlp if mlp is not None else GatedMLP(hidden_size, ffn_hidden_size, activation="silu", bias=mlp_bias,
                                                        dropout=hidden_dropout)
        # A table of head_dim / 2 frequencies (a non-persistent buffer: no checkpoint key).
        self.rotary = RotaryEmbedding(head_dim, max_position_embeddings, base=rope_theta, rope_scaling=rope_scaling)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        # The attention takes the rotary angles of the positions itself: it sees the whole sequence, while
        # under sequence parallelism x here is this rank's shard of it.
        x = x + self.attn(self.attn_norm(x), attention_mask=attention_mask, rotary=self.rotary,
                          position_ids=position_ids, kv_cache=kv_cache)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))


class LlamaDecoder(InitByModule, nn.Module):
    """The causal decoder :class:`LlamaModel` and :class:`dufu.models.moe.MoEModel` share: embedding, blocks,
    final norm, head, initialisation and forward. A family differs only in what ``_block(i, **kwargs)``
    builds; the families are siblings, not subclasses of one another, so a type check (the Hugging Face
    mapping a model exports through, pruning) never mistakes one for the other."""

    # What pipeline parallelism needs to split this model (see dufu.parallel.pipeline).
    pipeline_layout = {"blocks": "blocks", "first": ("wte",), "last": ("norm", "lm_head")}
    supports_context_parallel = True  # sequence chunks with their global positions (dufu.parallel.context_parallel)
    main_input_name = "input_ids"

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 4096,
        num_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        ffn_hidden_size: int = 11008,
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rope_scaling: Optional[dict] = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        mlp_bias: bool = False,
        embedding_dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fused_loss: bool = False,
        qk_norm: bool = False,
        pretrained: Optional[str] = None,
    ):
        super().__init__()
        num_key_value_heads = num_key_value_heads or num_attention_heads
        if head_dim is None:
            if hidden_size % num_attention_heads != 0:
                raise ValueError(f"{type(self).__name__}: hidden_size {hidden_size} must be divisible by "
                                 f"num_attention_heads {num_attention_heads} (or give head_dim)")
            head_dim = hidden_size // num_attention_heads
        if num_attention_heads % num_key_value_heads != 0:
            raise ValueError(f"{type(self).__name__}: num_attention_heads {num_attention_heads} must be a multiple of "
                             f"num_key_value_heads {num_key_value_heads}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.ffn_hidden_size = ffn_hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        self.fused_loss = fused_loss
        self.qk_norm = qk_norm
        # Names that hold one shared tensor: a checkpoint that has only one of them serves both.
        self.tied_parameter_names = {"lm_head.weight": "wte.weight"} if tie_word_embeddings else {}
        # False: forward returns a plain tensor (what a pipeline stage must return).
        self.return_dict = True

        self.wte = VocabEmbedding(vocab_size, hidden_size)
        self.drop = nn.Dropout(embedding_dropout)
        self.blocks = nn.ModuleDict({
            str(i): self._block(
                i, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                num_key_value_heads=num_key_value_heads, head_dim=head_dim, ffn_hidden_size=ffn_hidden_size,
                rms_norm_eps=rms_norm_eps, max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                rope_scaling=rope_scaling, qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias,
                attention_dropout=attention_dropout, hidden_dropout=hidden_dropout, qk_norm=qk_norm,
            )
            for i in range(num_layers)
        })
        self.norm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.lm_head = Linear(hidden_size, vocab_size, bias=False, parallel="col")
        self.finish_init(pretrained)

    def _block(self, i: int, **kwargs) -> nn.Module:
        """Block ``i`` from LlamaBlock's keyword arguments (MoEModel gives some blocks a mixture of experts)."""
        return LlamaBlock(layer_idx=i, **kwargs)

    # ------------------------------------------------------------------ init
    def init_module(self, name: str, module: nn.Module) -> None:
        """Every matrix and embedding N(0, initializer_range), biases 0, norm weights 1 (as Llama's
        reference initialisation); the rotary tables are recomputed (a meta build leaves them empty)."""
        self.init_normal(name, module, self.initializer_range)
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()

    def output_head(self) -> Optional[nn.Module]:
        return self.lm_head

    def token_embedding(self) -> Optional[nn.Module]:
        return self.wte

    # --------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        shift_labels: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ):
        """Hugging Face semantics: ``labels`` are the input ids (shifted inside, -100 ignored);
        ``shift_labels`` are already the next-token ids (what dufu's trainer passes).
        ``attention_mask`` (B, T_past + T): 1 for tokens, 0 for padding. ``position_ids`` (B|1, T): default
        ``past .. past + T - 1`` where past is the length already in ``kv_cache``; positions that restart inside
        a row mark packed samples or documents, which then attend only within themselves (block-causal, see
        :func:`~dufu.layers.attention.document_mask`; not with ``kv_cache``: a cache holds one sequence per
        row). On a later pipeline stage ``input_ids`` are the hidden states (B, T, C) of the stage before (every
        stage gets ``position_ids``). With ``fused_loss`` and labels, ``logits`` is None (see the class
        docstring)."""
        # Under context parallelism (dufu.parallel.context_parallel) position_ids are those of this rank's tokens and
        # the attention builds the masks itself over the whole sequence (documents from the split attention_mask).
        if position_ids is not None and kv_cache is None and context_parallel_of(self) is None:
            attention_mask = document_mask(position_ids, attention_mask)  # once for all blocks
        h = self.drop(self.wte(input_ids)) if self.wte is not None else input_ids  # (B, T, C)
        for block in self.blocks.values():
            h = block(h, attention_mask=attention_mask, position_ids=position_ids, kv_cache=kv_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.fused_loss and self.lm_head is not None and (labels is not None or shift_labels is not None):
            target = shift_labels if shift_labels is not None else next_token_labels(labels)  # (B, T)
            return ModelOutput(loss=fused_linear_cross_entropy(h, self.lm_head.weight, target))
        logits = self.lm_head(h) if self.lm_head is not None else h  # (B, T, V)
        if not self.return_dict and labels is None and shift_labels is None:
            return logits
        loss = None
        if shift_labels is not None:
            loss = causal_lm_loss(logits, shift_labels)
        elif labels is not None:
            loss = causal_lm_loss(logits[:, :-1], labels[:, 1:])
        return ModelOutput(loss=loss, logits=logits)


LlamaDecoder.pipeline_loss = staticmethod(causal_lm_loss)


class LlamaModel(LlamaDecoder):
    """Causal decoder of the LLaMA family. Llama 2/3: no biases, untied head. Qwen2: ``qkv_bias=True``
    (the small sizes also tie the head). Qwen3: ``qk_norm=True`` (an RMSNorm of ``head_dim`` on every query
    and key head before the rotation, :class:`dufu.layers.attention.HeadRMSNorm`), no biases, an explicit
    ``head_dim`` (Qwen3-8B: 32 heads of 128 in a hidden size of 4096). ``rope_scaling``: e.g.
    ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}``.

    ``pretrained``: a Hugging Face directory or a dufu run/checkpoint whose weights are loaded after
    building, by whoever builds the model (:mod:`dufu.engine.weights.pretrained`); the sizes given here must match it.

    ``fused_loss``: with labels, compute the head and the cross entropy together, chunk by chunk
    (:func:`dufu.layers.loss.fused_linear_cross_entropy`): the full (B, T, V) logits never exist, so the output
    then has ``loss`` and ``logits=None``. Without labels, and on pipeline stages (whose last stage returns
    logits to ``pipeline_loss``), the logits are computed as always. Off by default: it
    saves memory but measured no faster at the default recipe's shape (benchmarks/fused_loss.py)."""
