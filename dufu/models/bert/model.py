"""BERT (Devlin et al. 2019) and RoBERTa (Liu et al. 2019): bidirectional encoders, single-device code built
from dufu.layers.

::

    embeddings   wte(input_ids) + wpe(position_ids) + token_types(token_type_ids) -> ln_emb -> dropout
    blocks       post-LayerNorm: x = ln1(x + attn(x)); x = ln2(x + mlp(x))        (BERT's ordering)
    heads        BertModel: pooler (tanh(dense(h[:, 0])))
                 BertForMaskedLM: mlm_transform (dense, activation, LayerNorm) -> lm_head (tied to wte)
                 BertForSequenceClassification: pooler -> dropout -> classifier

RoBERTa is the same network with two differences, composed in by ``_RobertaPositions``: positions count
from ``pad_token_id + 1`` and skip padding (fairseq's ``make_positions``), and its classification head reads the
first token through ``dense -> tanh -> out_proj`` instead of BERT's pooler. RoBERTa checkpoints carry a
one-row token-type table, so "no token types" is just type 0 everywhere.

Like the GPT model, the embeddings and heads are direct attributes (``wte``, ``lm_head`` ...) and the blocks
live in a ``ModuleDict`` keyed ``str(i)``: pipeline parallelism deletes what a stage does not own (see
``pipeline_layout``) and tensor parallelism reads each layer's declared style, so nothing here knows about
ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dufu.layers import (
    MLP,
    Attention,
    LayerNorm,
    Linear,
    PositionEmbedding,
    TokenTypeEmbedding,
    VocabEmbedding,
)
from dufu.layers import init
from dufu.layers.loss import masked_lm_loss, sequence_classification_loss
from dufu.layers.mlp import ACTIVATIONS
from dufu.models.base import InitByModule
from dufu.models.outputs import ModelOutput


@dataclass
class EncoderOutput(ModelOutput):
    """``ModelOutput`` plus BERT's pooled first-token vector (``pooler_output``, as transformers names it)."""

    pooler_output: Optional[torch.Tensor] = None


class BertLayer(nn.Module):
    """Post-LayerNorm encoder block: ``ln1(x + attn(x))`` then ``ln2(x + mlp(x))`` (Vaswani et al. 2017,
    as BERT keeps it). ``layer_idx`` places the block on a pipeline stage."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_hidden_size: int,
        layer_idx: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-12,
        activation: str = "gelu",
        head_dim: Optional[int] = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn = Attention(hidden_size, num_heads, head_dim=head_dim, causal=False,
                              attention_dropout=attention_dropout, dropout=dropout)
        self.ln1 = LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.mlp = MLP(hidden_size, ffn_hidden_size, activation=activation, dropout=dropout)
        self.ln2 = LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.ln1(x + self.attn(x, attention_mask=attention_mask))  # (B, T, C)
        return self.ln2(x + self.mlp(x))


class Pooler(nn.Module):
    """``tanh(dense(h[:, 0]))``: BERT's sentence vector, trained by next-sentence prediction."""

    # Under sequence parallelism, gather the sequence first: the first token lives on one rank only.
    tensor_parallel_input = "replicate"

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(h[:, 0]))  # (B, C)


class TokenwiseLinear(nn.Linear):
    """A replicated linear map applied to each token on its own (no tensor-parallel split). Under sequence
    parallelism it runs on the sequence shard like the norms (torch's SequenceParallel style: replicated
    weights whose gradients are summed over the shards)."""

    sequence_parallel = True


class MaskedLMTransform(nn.Module):
    """The masked-LM head before the (tied) output projection: dense -> activation -> LayerNorm, token-wise."""

    def __init__(self, hidden_size: int, activation: str = "gelu", layernorm_epsilon: float = 1e-12):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.dense = TokenwiseLinear(hidden_size, hidden_size)
        self.ln = LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln(ACTIVATIONS[self.activation](self.dense(h)))


class RobertaClassificationHead(nn.Module):
    """RoBERTa's sentence head on the first token (``<s>``): dropout -> dense -> tanh -> dropout -> out_proj."""

    tensor_parallel_input = "replicate"  # as Pooler: the first token lives on one sequence-parallel rank

    def __init__(self, hidden_size: int, num_labels: int, dropout: float = 0.1):
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size)
        self.out_proj = Linear(hidden_size, num_labels)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.drop(h[:, 0])  # (B, C)
        x = self.drop(torch.tanh(self.dense(x)))
        return self.out_proj(x)  # (B, num_labels)


class _BertEncoder(InitByModule, nn.Module):
    """Embeddings and blocks shared by every BERT/RoBERTa class; subclasses add a head and call
    ``finish_init()`` at the end of their constructor."""

    main_input_name = "input_ids"
    # Sequence chunks with their global positions and the whole padding mask (dufu.parallel.context_parallel)
    supports_context_parallel = True
    # Parameters a checkpoint of the bare encoder does not have: they keep this model's own initialisation when
    # loaded with dufu.from_pretrained (a new task head, as transformers does for fine-tuning).
    newly_initialized_prefixes: tuple[str, ...] = ()

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_attention_heads: int = 12,
        ffn_hidden_size: Optional[int] = None,
        max_position_embeddings: int = 512,
        type_vocab_size: int = 2,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-12,
        activation: str = "gelu",
        pad_token_id: Optional[int] = 0,
        initializer_range: float = 0.02,
        head_dim: Optional[int] = None,
    ):
        """``head_dim``: the size of each attention head; default ``hidden_size // num_attention_heads`` (BERT).
        A pruned model (:mod:`dufu.compress.prune`) has fewer heads of the original size."""
        super().__init__()
        if head_dim is None:
            if hidden_size % num_attention_heads != 0:
                raise ValueError(
                    f"{type(self).__name__}: hidden_size {hidden_size} must be divisible by num_attention_heads "
                    f"{num_attention_heads} (or give head_dim)"
                )
            head_dim = hidden_size // num_attention_heads
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.pad_token_id = pad_token_id
        self.activation = activation
        self.initializer_range = initializer_range
        self.tie_word_embeddings = False
        self.tied_parameter_names: dict[str, str] = {}
        # False: forward returns a plain tensor, as a pipeline stage must (transformers' ``return_dict``).
        self.return_dict = True
        ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        self.ffn_hidden_size = ffn_hidden_size

        self.wte = VocabEmbedding(vocab_size, hidden_size)
        self.wpe = PositionEmbedding(max_position_embeddings, hidden_size)
        self.token_types = TokenTypeEmbedding(type_vocab_size, hidden_size)
        self.ln_emb = LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.drop = nn.Dropout(hidden_dropout)
        self.blocks = nn.ModuleDict(
            {
                str(i): BertLayer(hidden_size, num_attention_heads, ffn_hidden_size, layer_idx=i,
                                  dropout=hidden_dropout, attention_dropout=attention_dropout,
                                  layernorm_epsilon=layernorm_epsilon, activation=activation, head_dim=head_dim)
                for i in range(num_layers)
            }
        )


    # ------------------------------------------------------------------ init
    def init_module(self, name: str, module: nn.Module) -> None:
        """BERT's initialisation: N(0, initializer_range) for matrices and tables (the padding row zero),
        zero biases, unit LayerNorms."""
        self.init_normal(name, module, self.initializer_range)
        if name == "wte" and self.pad_token_id is not None and 0 <= self.pad_token_id < self.vocab_size:
            init.constant_(module.weight, 0.0, rows=range(self.pad_token_id, self.pad_token_id + 1))

    def token_embedding(self) -> Optional[nn.Module]:
        return self.wte

    # --------------------------------------------------------------- forward
    def position_offset(self) -> int:
        """The position of the first token (BERT's positions, ``default_position_ids``, are 0 .. T-1)."""
        return 0

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The last hidden states (B, T, C). On a later pipeline stage ``input_ids`` are hidden states."""
        if self.wte is not None:
            if position_ids is None:
                T = input_ids.shape[1]
                if T + self.position_offset() > self.max_position_embeddings:
                    raise ValueError(
                        f"sequence length {T} exceeds max_position_embeddings {self.max_position_embeddings}"
                        + (f" - {self.position_offset()} (positions start at {self.position_offset()})"
                           if self.position_offset() else "")
                    )
                position_ids = self.default_position_ids(input_ids)  # (1|B, T)
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)  # (B, T): every token is segment A
            h = self.wte(input_ids) + self.wpe(position_ids) + self.token_types(token_type_ids)  # (B, T, C)
            h = self.drop(self.ln_emb(h))
        else:
            h = input_ids  # a later pipeline stage receives hidden states (B, T, C)
        for block in self.blocks.values():
            h = block(h, attention_mask=attention_mask)
        return h


class BertModel(_BertEncoder):
    """The bare encoder (transformers' ``BertModel``): ``last_hidden_state`` (B, T, C) and ``pooler_output``
    (B, C). Sentence-embedding models (e.g. all-MiniLM-L6-v2) are this class plus mean pooling."""

    pipeline_layout = {"blocks": "blocks", "first": ("wte", "wpe", "token_types", "ln_emb"), "last": ("pooler",)}
    newly_initialized_prefixes = ("pooler.",)  # a masked-LM checkpoint has no pooler

    def __init__(self, *args, add_pooling_layer: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.pooler = Pooler(self.hidden_size) if add_pooling_layer else None
        self.finish_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ):
        """``attention_mask`` (B, T): 1 for tokens, 0 for padding."""
        h = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        if not self.return_dict:
            return h
        pooled = self.pooler(h) if self.pooler is not None else None
        return EncoderOutput(last_hidden_state=h, pooler_output=pooled)


class _BertWithHead(_BertEncoder):
    """The encoder, then the subclass's ``head``; with ``labels``, the loss is the class's ``pipeline_loss``
    (the same function a pipeline's last stage uses)."""

    def head(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
    ):
        h = self.head(self.encode(input_ids, attention_mask, token_type_ids, position_ids))
        if not self.return_dict and labels is None:
            return h
        loss = type(self).pipeline_loss(h, labels) if labels is not None else None
        return ModelOutput(loss=loss, logits=h)


class BertForMaskedLM(_BertWithHead):
    """BERT with the masked-LM head; the output projection shares the token embedding (``tie_word_embeddings``).

    ``labels`` (B, T) hold the original token at masked positions and -100 elsewhere (see dufu.data.mlm)."""

    pipeline_layout = {"blocks": "blocks", "first": ("wte", "wpe", "token_types", "ln_emb"),
                       "last": ("mlm_transform", "lm_head")}
    newly_initialized_prefixes = ("mlm_transform.", "lm_head.")
    head_activation: Optional[str] = None  # None: the encoder's activation (BERT); RoBERTa's head is always GELU

    def __init__(self, *args, tie_word_embeddings: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        activation = self.head_activation or self.activation
        eps = self.ln_emb.eps
        self.tie_word_embeddings = tie_word_embeddings
        # Names that hold one shared tensor: a checkpoint that has only one of them serves both.
        self.tied_parameter_names = {"lm_head.weight": "wte.weight"} if tie_word_embeddings else {}
        self.mlm_transform = MaskedLMTransform(self.hidden_size, activation, eps)
        # The output head: column-parallel, so under tensor parallelism the logits stay split by vocabulary
        # into the loss; its bias is BERT's per-token output bias.
        self.lm_head = Linear(self.hidden_size, self.vocab_size, bias=True, parallel="col")
        self.finish_init()

    def output_head(self) -> Optional[nn.Module]:
        return self.lm_head

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.mlm_transform is not None:  # (None on pipeline stages other than the last)
            h = self.mlm_transform(h)
        if self.lm_head is not None:
            h = self.lm_head(h)  # (B, T, V)
        return h


BertForMaskedLM.pipeline_loss = staticmethod(masked_lm_loss)


class BertForSequenceClassification(_BertWithHead):
    """BERT with ``pooler -> dropout -> classifier``; ``labels`` (B,) class ids, or floats for regression
    (``num_labels=1``) and multi-label tasks."""

    pipeline_layout = {"blocks": "blocks", "first": ("wte", "wpe", "token_types", "ln_emb"),
                       "last": ("pooler", "classifier_dropout", "classifier")}
    newly_initialized_prefixes = ("pooler.", "classifier.")
    supports_context_parallel = False
    context_parallel_unsupported_reason = (
        "its label belongs to the whole sequence and is read from the first token, which one rank of a context-"
        "parallel group holds; sequences short enough to classify fit one rank")

    def __init__(self, *args, num_labels: int = 2, classifier_dropout: Optional[float] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_labels = num_labels
        self._build_head(num_labels, self.drop.p if classifier_dropout is None else classifier_dropout)
        self.finish_init()

    def _build_head(self, num_labels: int, dropout: float) -> None:
        self.pooler = Pooler(self.hidden_size)
        self.classifier_dropout = nn.Dropout(dropout)
        self.classifier = Linear(self.hidden_size, num_labels)

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.classifier_dropout(self.pooler(h)))  # (B, num_labels)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.classify(h) if self.classifier is not None else h  # (None on stages but the last)


BertForSequenceClassification.pipeline_loss = staticmethod(sequence_classification_loss)


# ---------------------------------------------------------------------- RoBERTa
class _RobertaPositions:
    """RoBERTa's positions (fairseq's ``make_positions``): tokens count from ``pad_token_id + 1``, padding
    tokens keep position ``pad_token_id``. So sequences fit ``max_position_embeddings - pad_token_id - 1``."""

    def position_offset(self) -> int:
        return self.pad_token_id + 1

    def default_position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        pad = self.pad_token_id
        keep = (input_ids != pad).long()  # (B, T)
        return torch.cumsum(keep, dim=1) * keep + pad  # (B, T)


_ROBERTA_DEFAULTS = dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                         layernorm_epsilon=1e-5)


class RobertaModel(_RobertaPositions, BertModel):
    """transformers' ``RobertaModel``: ``BertModel`` with RoBERTa positions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**_ROBERTA_DEFAULTS, **kwargs})


class RobertaForMaskedLM(_RobertaPositions, BertForMaskedLM):
    """transformers' ``RobertaForMaskedLM``: RoBERTa positions; the head's activation is always GELU."""

    head_activation = "gelu"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**_ROBERTA_DEFAULTS, **kwargs})


class RobertaForSequenceClassification(_RobertaPositions, BertForSequenceClassification):
    """transformers' ``RobertaForSequenceClassification``: no pooler; ``dense -> tanh -> out_proj`` on ``<s>``."""

    pipeline_layout = {"blocks": "blocks", "first": ("wte", "wpe", "token_types", "ln_emb"), "last": ("classifier",)}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**_ROBERTA_DEFAULTS, **kwargs})

    def _build_head(self, num_labels: int, dropout: float) -> None:
        self.classifier = RobertaClassificationHead(self.hidden_size, num_labels, dropout)

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(h)

