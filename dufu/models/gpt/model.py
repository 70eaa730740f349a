"""GPT-2 architecture (Radford et al. 2019), single-device code built from dufu.layers.

Blocks live in a ``ModuleDict`` keyed by ``str(i)`` so that parameter names
(``blocks.3.attn.q_proj.weight``) stay the same when pipeline parallelism keeps
only some of the blocks on a stage. A stage that does not own the embeddings
or the head has those attributes set to ``None``; ``forward`` then takes and
returns hidden states.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from dufu.layers import KVCache, LayerNorm, Linear, PositionEmbedding, TransformerLayer, VocabEmbedding
from dufu.layers.attention import context_parallel_of, document_mask
from dufu.layers.loss import causal_lm_loss, fused_linear_cross_entropy, next_token_labels
from dufu.models.outputs import ModelOutput
from dufu.models.base import InitByModule


class GPTModel(InitByModule, nn.Module):
    # What pipeline parallelism needs to split this model (see dufu.parallel.pipeline):
    # blocks live in `blocks`; the first stage keeps `first`, the last keeps `last`.
    pipeline_layout = {"blocks": "blocks", "first": ("wte", "wpe"), "last": ("ln_f", "lm_head")}
    supports_context_parallel = True  # sequence chunks with their global positions (dufu.parallel.context_parallel)
    main_input_name = "input_ids"
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_attention_heads: int = 12,
        ffn_hidden_size: Optional[int] = None,
        max_position_embeddings: int = 1024,
        embedding_dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        layernorm_epsilon: float = 1e-5,
        activation: str = "gelu_tanh",
        bias: bool = True,
        tie_word_embeddings: bool = True,
        initializer_range: float = 0.02,
        fused_loss: bool = False,
        pretrained: Optional[str] = None,
        head_dim: Optional[int] = None,
    ):
        """``head_dim``: the size of each attention head; default ``hidden_size // num_attention_heads`` (GPT-2).
        A pruned model (:mod:`dufu.compress.prune`) has fewer heads of the original size, so
        ``num_attention_heads * head_dim`` may be less than ``hidden_size``.

        ``pretrained``: a Hugging Face directory or a dufu run/checkpoint whose weights are loaded after
        building, by whoever builds the model (:mod:`dufu.engine.weights.pretrained`); the sizes given here must match it.

        ``fused_loss``: with labels, compute the head and the cross entropy together, chunk by chunk
        (:func:`dufu.layers.loss.fused_linear_cross_entropy`): the full (B, T, V) logits never exist, so the
        output then has ``loss`` and ``logits=None``. Without labels, and on pipeline stages (whose last stage
        returns logits to ``pipeline_loss``), the logits are computed as always. Off by default: it
        saves memory but measured no faster at the default recipe's shape (benchmarks/fused_loss.py)."""
        super().__init__()
        if head_dim is None:
            if hidden_size % num_attention_heads != 0:
                raise ValueError(f"GPTModel: hidden_size {hidden_size} must be divisible by num_attention_heads "
                                 f"{num_attention_heads} (or give head_dim)")
            head_dim = hidden_size // num_attention_heads
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        self.fused_loss = fused_loss
        # Names that hold one shared tensor: a checkpoint that has only one of them serves both.
        self.tied_parameter_names = {"lm_head.weight": "wte.weight"} if tie_word_embeddings else {}
        # False: forward returns a plain tensor (logits, or hidden states on an inner pipeline stage),
        # as a pipeline stage must; like transformers' ``return_dict``.
        self.return_dict = True
        ffn_hidden_size = ffn_hidden_size or 4 * hidden_size

        self.wte = VocabEmbedding(vocab_size, hidden_size)
        self.wpe = PositionEmbedding(max_position_embeddings, hidden_size)
        self.drop = nn.Dropout(embedding_dropout)
        self.blocks = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    hidden_size,
                    num_attention_heads,
                    ffn_hidden_size,
                    layer_idx=i,
                    dropout=hidden_dropout,
                    attention_dropout=attention_dropout,
                    layernorm_epsilon=layernorm_epsilon,
                    activation=activation,
                    bias=bias,
                    head_dim=head_dim,
                )
                for i in range(num_layers)
            }
        )
        self.ln_f = LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.lm_head = Linear(hidden_size, vocab_size, bias=False, parallel="col")
        self.finish_init(pretrained)

    # ------------------------------------------------------------------ init
    def init_module(self, name: str, module: nn.Module) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * num_layers)."""
        std = self.initializer_range
        if name.endswith(("out_proj", "fc2")):
            std = std / math.sqrt(2 * self.num_layers)
        self.init_normal(name, module, std)

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
    ) -> ModelOutput:
        """Hugging Face semantics: ``labels`` are the input ids (shifted inside, -100 ignored);
        ``shift_labels`` are already the next-token ids (what dufu's trainer passes, no token wasted).
        ``attention_mask`` (B, T_past + T): 1 for tokens, 0 for padding. ``kv_cache``: keys and values of
        earlier positions (incremental decoding); ``position_ids`` then default to ``past .. past + T - 1``.
        ``position_ids`` (B|1, T) that restart inside a row mark packed samples or documents, which then attend
        only within themselves (block-causal, see :func:`~dufu.layers.attention.document_mask`; not with
        ``kv_cache``: a cache holds one sequence per row); every pipeline stage gets them.
        With ``fused_loss`` and labels, ``logits`` is None (see __init__)."""
        hidden = self.hidden_states(input_ids, position_ids, attention_mask, kv_cache)
        if self.fused_loss and self.lm_head is not None and (labels is not None or shift_labels is not None):
            target = shift_labels if shift_labels is not None else next_token_labels(labels)  # (B, T)
            h = self.ln_f(hidden) if self.ln_f is not None else hidden
            return ModelOutput(loss=fused_linear_cross_entropy(h, self.lm_head.weight, target))
        logits = self.head(hidden)
        if not self.return_dict and labels is None and shift_labels is None:
            return logits
        loss = None
        if shift_labels is not None:
            loss = causal_lm_loss(logits, shift_labels)
        elif labels is not None:
            loss = causal_lm_loss(logits[:, :-1], labels[:, 1:])
        return ModelOutput(loss=loss, logits=logits)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                      attention_mask: Optional[torch.Tensor] = None,
                      kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        # Under context parallelism (dufu.parallel.context_parallel) position_ids are those of this rank's tokens and
        # the attention builds the masks itself over the whole sequence (documents from the split attention_mask).
        if position_ids is not None and kv_cache is None and context_parallel_of(self) is None:
            attention_mask = document_mask(position_ids, attention_mask)  # once for all blocks
        if self.wte is not None:
            B, T = input_ids.shape
            past = 0
            if kv_cache is not None and len(self.blocks):
                cached = kv_cache.get(next(iter(self.blocks.values())).attn)
                past = 0 if cached is None else cached[0].shape[2] - getattr(kv_cache, "virtual_tokens", 0)
            if position_ids is None:
                if past + T > self.max_position_embeddings:
                    raise ValueError(
                        f"sequence length {past + T} exceeds max_position_embeddings {self.max_position_embeddings}"
                    )
                position_ids = torch.arange(past, past + T, device=input_ids.device).unsqueeze(0)  # (1, T)
            h = self.drop(self.wte(input_ids) + self.wpe(position_ids))  # (B, T, C)
        else:
            h = input_ids  # a later pipeline stage receives hidden states (B, T, C)
        for block in self.blocks.values():
            h = block(h, attention_mask=attention_mask, kv_cache=kv_cache)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.ln_f is not None:
            h = self.ln_f(h)
        if self.lm_head is not None:
            h = self.lm_head(h)  # (B, T, V)
        return h


GPTModel.pipeline_loss = staticmethod(causal_lm_loss)
