"""T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer"), single-device code built from dufu.layers.

What makes T5 differ from a GPT-style block, all from section 2.1 of the paper:

* pre-norm blocks with a scale-only RMS norm (no mean subtraction, no bias),
* no absolute positions: a learned scalar per (relative-distance bucket, head), added to the attention
  logits; each stack computes it once (in its first layer) and every layer reuses it,
* attention logits are not divided by sqrt(head_dim) (the initialisation absorbs it): ``scale=1``,
* no biases anywhere; the feed-forward block is ReLU (T5) or gated GELU (T5 v1.1, Shazeer 2020),
* the token embedding is shared by encoder and decoder; with a tied output head the decoder output is
  multiplied by ``d_model ** -0.5`` before the head.

Both stacks keep their blocks in a ``ModuleDict`` keyed ``str(i)`` (``encoder.blocks.3...``). The
relative-bias tables are :class:`~dufu.layers.HeadwiseEmbedding` (``parallel="col"``), so tensor
parallelism gives every rank the bias columns of its own heads.

Pipeline parallelism (``T5ForConditionalGeneration.pipeline_forward``) places the encoder blocks, then the
decoder blocks, in one stage order (as LiBai places T5). The first stage embeds both the encoder input and the
decoder input (the embedding is shared, so it lives on one stage) and sends the decoder embeddings along with
the encoder hidden states; each stack's relative bias lives on the stage of its first block, which sends the
computed bias on to the next stages of that stack, so every parameter keeps one owner and one name.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dufu.layers import MLP, Attention, GatedMLP, HeadwiseEmbedding, KVCache, Linear, RMSNorm, VocabEmbedding
from dufu.layers import init
from dufu.layers.attention import padding_mask_to_bias
from dufu.layers.loss import seq2seq_lm_loss
from dufu.models.base import InitByModule
from dufu.models.outputs import ModelOutput
from dufu.models.t5.relative_bias import T5RelativeBias

FEED_FORWARD = ("relu", "gated-gelu")


class T5Block(nn.Module):
    """``x + self_attn(norm(x))``, (decoder) ``x + cross_attn(norm(x), encoder)``, ``x + ff(norm(x))``."""

    def __init__(self, d_model: int, num_heads: int, d_kv: int, d_ff: int, layer_idx: int, is_decoder: bool,
                 feed_forward_proj: str = "relu", dropout: float = 0.0, layer_norm_epsilon: float = 1e-6):
        super().__init__()
        self.layer_idx = layer_idx
        attn = dict(head_dim=d_kv, qkv_bias=False, out_bias=False, attention_dropout=dropout, dropout=dropout,
                    scale=1.0)
        self.ln_self = RMSNorm(d_model, eps=layer_norm_epsilon)
        self.self_attn = Attention(d_model, num_heads, causal=is_decoder, **attn)
        if is_decoder:
            self.ln_cross = RMSNorm(d_model, eps=layer_norm_epsilon)
            self.cross_attn = Attention(d_model, num_heads, causal=False, **attn)
        else:
            self.ln_cross = self.cross_attn = None
        self.ln_mlp = RMSNorm(d_model, eps=layer_norm_epsilon)
        if feed_forward_proj == "relu":
            self.mlp = MLP(d_model, d_ff, activation="relu", bias=False, dropout=dropout)
        else:  # gated-gelu: T5 v1.1 uses the tanh approximation ("gelu_new")
            self.mlp = GatedMLP(d_model, d_ff, activation="gelu_tanh", bias=False, dropout=dropout)

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor] = None,
                encoder_bias: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        # kv_cache: the self-attention appends this step's keys/values; the cross-attention computes the
        # encoder's keys/values on the first step and reuses them after (see Attention.forward)
        x = x + self.self_attn(self.ln_self(x), position_bias=position_bias, kv_cache=kv_cache)
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.ln_cross(x), attention_mask=encoder_bias, kv=encoder_hidden_states,
                                    kv_cache=kv_cache)
        return x + self.mlp(self.ln_mlp(x))


class T5Stack(nn.Module):
    """The encoder (bidirectional) or the decoder (causal, with cross-attention): blocks + final norm."""

    def __init__(self, num_layers: int, d_model: int, num_heads: int, d_kv: int, d_ff: int, is_decoder: bool,
                 feed_forward_proj: str, dropout: float, layer_norm_epsilon: float, num_buckets: int,
                 max_distance: int):
        super().__init__()
        self.is_decoder = is_decoder
        self.relative_bias = T5RelativeBias(num_heads, num_buckets, max_distance, bidirectional=not is_decoder)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleDict({
            str(i): T5Block(d_model, num_heads, d_kv, d_ff, layer_idx=i, is_decoder=is_decoder,
                            feed_forward_proj=feed_forward_proj, dropout=dropout,
                            layer_norm_epsilon=layer_norm_epsilon)
            for i in range(num_layers)
        })
        self.final_norm = RMSNorm(d_model, eps=layer_norm_epsilon)

    def forward(self, h: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                encoder_hidden_states: Optional[torch.Tensor] = None,
                encoder_attention_mask: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """h: embedded tokens (B, T, C); masks (B, T) / (B, S) with 1 = token, 0 = padding. ``kv_cache``
        (decoder, incremental decoding): h holds the positions after those already cached, and
        ``attention_mask`` covers the cached positions too, (B, past + T)."""
        T = h.shape[1]
        past = 0
        if kv_cache is not None and len(self.blocks):
            cached = kv_cache.get(next(iter(self.blocks.values())).self_attn)
            past = 0 if cached is None else cached[0].shape[2]
        # (1, nh, T, past + T): the rows of queries past .. past + T - 1; the decoder's causal mask is added
        # in Attention
        bias = self.relative_bias(T, past + T, offset=past)
        if attention_mask is not None:
            bias = bias + padding_mask_to_bias(attention_mask, bias.dtype)  # (B, nh, T, T)
        encoder_bias = None
        if encoder_hidden_states is not None and encoder_attention_mask is not None:
            encoder_bias = padding_mask_to_bias(encoder_attention_mask, h.dtype)  # (B, 1, 1, S)
        h = self.drop(h)
        for block in self.blocks.values():
            h = block(h, bias, encoder_hidden_states, encoder_bias, kv_cache=kv_cache)
        return self.drop(self.final_norm(h))


class _T5Base(InitByModule, nn.Module):
    main_input_name = "input_ids"
    # Sequence parallelism is not supported: the relative bias and the cross-attention keys need the
    # whole sequence, while SP hands each block a sequence shard. A start-up check can refuse it with this:
    sequence_parallel_unsupported_reason = (
        "T5's relative position bias and its cross-attention need the whole sequence in every block"
    )
    context_parallel_unsupported_reason = (
        "an encoder-decoder: the decoder's cross-attention reads the encoder's whole output and the relative "
        "position bias is indexed by query-key distance over the whole sequence, which the chunked attention of "
        "context parallelism does not carry")

    def _init_common(self, vocab_size, d_model, d_kv, d_ff, num_layers, num_heads, feed_forward_proj,
                     relative_attention_num_buckets, relative_attention_max_distance, dropout_rate,
                     layer_norm_epsilon, initializer_factor):
        if feed_forward_proj not in FEED_FORWARD:
            raise ValueError(f"T5: feed_forward_proj={feed_forward_proj!r}; expected one of {FEED_FORWARD}")
        self.vocab_size = vocab_size
        self.hidden_size = self.d_model = d_model
        self.d_kv = d_kv
        self.d_ff = d_ff
        self.num_layers = num_layers
        self.num_attention_heads = num_heads
        self.feed_forward_proj = feed_forward_proj
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.dropout_rate = dropout_rate
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_factor = initializer_factor
        self.wte = VocabEmbedding(vocab_size, d_model)

    def _stack(self, num_layers: int, is_decoder: bool) -> T5Stack:
        return T5Stack(num_layers, self.d_model, self.num_attention_heads, self.d_kv, self.d_ff, is_decoder,
                       self.feed_forward_proj, self.dropout_rate, self.layer_norm_epsilon,
                       self.relative_attention_num_buckets, self.relative_attention_max_distance)

    def init_module(self, name: str, module: nn.Module) -> None:
        """Mesh TensorFlow's T5 initialisation (as in the paper's code): each matrix N(0, fan_in^-1/2), where
        the query also absorbs the missing 1/sqrt(d_kv) of the attention; embeddings N(0, 1); norms 1."""
        f = self.initializer_factor
        d, inner = self.d_model, self.num_attention_heads * self.d_kv
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear):
            if self.is_tied_alias(f"{name}.weight"):
                return
            if leaf == "lm_head":
                # untied head: N(0, d^-1/2) keeps the initial logits ~N(0, 1), so the first loss is ~log(vocab)
                std = d ** -0.5
            elif leaf == "q_proj":
                std = (d * self.d_kv) ** -0.5
            elif leaf in ("k_proj", "v_proj"):
                std = d ** -0.5
            elif leaf == "out_proj":
                std = inner ** -0.5
            else:  # the feed-forward's wi (d_model^-1/2) and wo (d_ff^-1/2): fan-in
                std = module.in_features ** -0.5
            init.normal_(module.weight, std=f * std)
        elif isinstance(module, HeadwiseEmbedding):
            init.normal_(module.weight, std=f * d ** -0.5)
        elif isinstance(module, VocabEmbedding):
            init.normal_(module.weight, std=f * 1.0)
        elif isinstance(module, nn.RMSNorm):
            init.constant_(module.weight, f * 1.0)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)  # (B, T, C)

    def token_embedding(self) -> Optional[nn.Module]:
        return self.wte


class T5ForConditionalGeneration(_T5Base):
    """T5 encoder-decoder with a language-model head (as transformers' ``T5ForConditionalGeneration``).

    ``scale_decoder_outputs`` (default: ``tie_word_embeddings``) multiplies the decoder output by
    ``d_model ** -0.5`` before the head, as T5 does with its tied head. ``pad_token_id`` and
    ``decoder_start_token_id`` (default: the pad id, as in T5) are used to shift labels right.
    """

    has_lm_head = True
    # Pipeline stages: encoder blocks then decoder blocks. The shared embedding is the first stage's; each
    # relative bias belongs to the stage of its stack's first block, the encoder's final norm to the stage of
    # its last block (see dufu.parallel.pipeline.build_stage_module).
    pipeline_layout = {
        "blocks": ("encoder.blocks", "decoder.blocks"),
        "first": ("wte",),
        "last": ("decoder.final_norm", "lm_head"),
        "before": {"encoder.relative_bias": "encoder.blocks", "decoder.relative_bias": "decoder.blocks"},
        "after": {"encoder.final_norm": "encoder.blocks"},
    }

    def __init__(
        self,
        vocab_size: int = 32128,
        d_model: int = 512,
        d_kv: int = 64,
        d_ff: int = 2048,
        num_layers: int = 6,
        num_decoder_layers: Optional[int] = None,
        num_heads: int = 8,
        feed_forward_proj: str = "relu",
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        dropout_rate: float = 0.1,
        layer_norm_epsilon: float = 1e-6,
        tie_word_embeddings: bool = True,
        scale_decoder_outputs: Optional[bool] = None,
        pad_token_id: int = 0,
        decoder_start_token_id: Optional[int] = None,
        initializer_factor: float = 1.0,
    ):
        super().__init__()
        lm_head = self.has_lm_head
        self._init_common(vocab_size, d_model, d_kv, d_ff, num_layers, num_heads, feed_forward_proj,
                          relative_attention_num_buckets, relative_attention_max_distance, dropout_rate,
                          layer_norm_epsilon, initializer_factor)
        self.num_decoder_layers = num_layers if num_decoder_layers is None else num_decoder_layers
        self.tie_word_embeddings = tie_word_embeddings
        self.scale_decoder_outputs = tie_word_embeddings if scale_decoder_outputs is None else scale_decoder_outputs
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = pad_token_id if decoder_start_token_id is None else decoder_start_token_id
        self.tied_parameter_names = {"lm_head.weight": "wte.weight"} if (tie_word_embeddings and lm_head) else {}
        self.return_dict = True
        self.encoder = self._stack(num_layers, is_decoder=False)
        self.decoder = self._stack(self.num_decoder_layers, is_decoder=True)
        self.lm_head = Linear(d_model, vocab_size, bias=False, parallel="col") if lm_head else None
        self.finish_init()

    @property
    def attention_layers(self) -> int:
        """For the MFU estimate (12 L H T FLOP/token): the encoder's self-attention, the decoder's self and cross."""
        return self.num_layers + 2 * self.num_decoder_layers

    def output_head(self) -> Optional[nn.Module]:
        return self.lm_head

    def untie_weights(self) -> None:
        """Give the head its own copy of the embedding (e.g. to load a checkpoint whose head differs)."""
        self.tie_word_embeddings = False
        self.tied_parameter_names = {}
        if self.lm_head is not None:
            self.lm_head.weight = nn.Parameter(self.wte.weight.detach().clone())

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs from targets: ``[start, y0, y1, ...]``; ignored (-100) labels become padding."""
        start = torch.full_like(labels[:, :1], self.decoder_start_token_id)
        shifted = torch.cat([start, labels[:, :-1]], dim=1)
        return shifted.masked_fill(shifted == -100, self.pad_token_id)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The decoder inputs for ``labels`` (transformers' name; a pipeline's first stage gets them so)."""
        return self.shift_right(labels)

    def encode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.encoder(self._embed(input_ids), attention_mask)  # (B, S, C)

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input_ids: Optional[torch.Tensor] = None,
        decoder_attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        encoder_outputs: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> ModelOutput:
        """Hugging Face semantics: ``labels`` (B, T) are the target ids (-100 = ignored); without
        ``decoder_input_ids`` the decoder reads the labels shifted right. ``encoder_outputs``: a
        precomputed encoder output (B, S, C) to reuse (e.g. while decoding). ``kv_cache``: incremental
        decoding; ``decoder_input_ids`` are then the tokens after those already cached (the decoder's
        self-attention keys/values grow in the cache, the cross-attention ones are computed once)."""
        enc = self.encode(input_ids, attention_mask) if encoder_outputs is None else encoder_outputs
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError(f"{type(self).__name__} needs decoder_input_ids or labels (to shift right into decoder inputs)")
            decoder_input_ids = self.shift_right(labels)
        dec = self.decoder(self._embed(decoder_input_ids), decoder_attention_mask, enc, attention_mask, kv_cache)
        if self.lm_head is None:
            return ModelOutput(last_hidden_state=dec)
        if self.scale_decoder_outputs:
            dec = dec * self.d_model ** -0.5
        logits = self.lm_head(dec)  # (B, T, V)
        loss = seq2seq_lm_loss(logits, labels) if labels is not None else None
        return ModelOutput(loss=loss, logits=logits)

    def pipeline_forward(
        self,
        *received: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input_ids: Optional[torch.Tensor] = None,
        decoder_attention_mask: Optional[torch.Tensor] = None,
    ):
        """One pipeline stage: the computation of ``forward``, cut after any block.

        The masks and ``decoder_input_ids`` reach every stage as keywords; ``received`` is what the stage
        before sent, which depends on where this stage starts:

        * first stage: ``(input_ids,)``;
        * inside the encoder: ``(encoder hidden (B, S, C), decoder embeddings (B, T, C), encoder relative
          bias (1, nh, S, S))``;
        * at the first decoder block: ``(encoder output, decoder embeddings)``;
        * inside the decoder: ``(encoder output, decoder hidden (B, T, C), decoder relative bias (1, nh, T, T))``.

        A stage returns the tuple the next one expects; the last stage returns the logits (B, T, V)."""
        enc, dec = self.encoder, self.decoder
        if self.wte is not None:
            (input_ids,) = received
            if decoder_input_ids is None:
                raise ValueError(f"{type(self).__name__}: the first pipeline stage needs decoder_input_ids")
            h, dec_h, enc_rel = enc.drop(self._embed(input_ids)), self._embed(decoder_input_ids), None
        elif len(enc.blocks):
            h, dec_h, enc_rel = received
        elif dec.relative_bias is not None:
            h, dec_h = received
        else:
            h, dec_h, dec_rel = received
        if len(enc.blocks):  # this stage runs encoder blocks
            if enc.relative_bias is not None:
                enc_rel = enc.relative_bias(h.shape[1], h.shape[1])  # (1, nh, S, S)
            bias = enc_rel
            if attention_mask is not None:
                bias = bias + padding_mask_to_bias(attention_mask, bias.dtype)  # (B, nh, S, S)
            for block in enc.blocks.values():
                h = block(h, bias)
            if enc.final_norm is None:  # the encoder goes on in the next stage
                return h, dec_h, enc_rel
            h = enc.drop(enc.final_norm(h))  # the encoder output (B, S, C)
            if not len(dec.blocks):
                return h, dec_h
        if dec.relative_bias is not None:  # this stage runs the first decoder block
            dec_rel = dec.relative_bias(dec_h.shape[1], dec_h.shape[1])  # (1, nh, T, T)
            dec_h = dec.drop(dec_h)
        bias = dec_rel
        if decoder_attention_mask is not None:
            bias = bias + padding_mask_to_bias(decoder_attention_mask, bias.dtype)  # (B, nh, T, T)
        cross_bias = padding_mask_to_bias(attention_mask, dec_h.dtype) if attention_mask is not None else None
        for block in dec.blocks.values():
            dec_h = block(dec_h, bias, h, cross_bias)
        if dec.final_norm is None:  # the decoder goes on in the next stage
            return h, dec_h, dec_rel
        dec_h = dec.drop(dec.final_norm(dec_h))
        if self.lm_head is None:
            return dec_h
        if self.scale_decoder_outputs:
            dec_h = dec_h * self.d_model ** -0.5
        return self.lm_head(dec_h)  # (B, T, V)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, attention_mask: Optional[torch.Tensor] = None,
                 eos_token_id: Optional[int] = None) -> torch.Tensor:
        """Greedy decoding (the encoder runs once, the decoder one token per step on a key/value cache) ->
        (B, 1 + n) ids starting with the decoder start token. ``dufu.engine.inference.generate`` adds beam search,
        sampling and repetition penalties."""
        enc = self.encode(input_ids, attention_mask)
        out = torch.full((input_ids.shape[0], 1), self.decoder_start_token_id, dtype=torch.long, device=input_ids.device)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        cache = KVCache()
        for _ in range(max_new_tokens):
            logits = self(attention_mask=attention_mask, decoder_input_ids=out[:, -1:], encoder_outputs=enc,
                          kv_cache=cache).logits
            nxt = logits[:, -1].float().argmax(-1)
            if eos_token_id is not None:
                nxt = nxt.masked_fill(done, self.pad_token_id)
                done |= nxt == eos_token_id
            out = torch.cat([out, nxt[:, None]], dim=1)
            if eos_token_id is not None and bool(done.all()):
                break
        return out


class T5Model(T5ForConditionalGeneration):
    """The encoder-decoder without the head (as transformers' ``T5Model``): forward returns the decoder's
    ``last_hidden_state`` (B, T, C)."""

    has_lm_head = False


class T5EncoderModel(_T5Base):
    """The T5 encoder alone (transformers' ``T5EncoderModel``): returns ``last_hidden_state`` (B, S, C)."""

    # No `pipeline_layout`: pipeline parallelism refuses the model with a LayoutError. The reason, for messages:
    pipeline_unsupported_reason = (
        "pipeline stages are implemented for the encoder-decoder (T5ForConditionalGeneration), not for the "
        "encoder alone."
    )

    def __init__(
        self,
        vocab_size: int = 32128,
        d_model: int = 512,
        d_kv: int = 64,
        d_ff: int = 2048,
        num_layers: int = 6,
        num_heads: int = 8,
        feed_forward_proj: str = "relu",
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        dropout_rate: float = 0.1,
        layer_norm_epsilon: float = 1e-6,
        initializer_factor: float = 1.0,
    ):
        super().__init__()
        self._init_common(vocab_size, d_model, d_kv, d_ff, num_layers, num_heads, feed_forward_proj,
                          relative_attention_num_buckets, relative_attention_max_distance, dropout_rate,
                          layer_norm_epsilon, initializer_factor)
        self.tie_word_embeddings = False
        self.encoder = self._stack(num_layers, is_decoder=False)
        self.finish_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> ModelOutput:
        return ModelOutput(last_hidden_state=self.encoder(self._embed(input_ids), attention_mask))


T5ForConditionalGeneration.pipeline_loss = staticmethod(seq2seq_lm_loss)


def count_t5_parameters(vocab_size: int, d_model: int, d_kv: int, d_ff: int, num_layers: int, num_heads: int,
                        num_decoder_layers: Optional[int] = None, feed_forward_proj: str = "relu",
                        num_buckets: int = 32, tie_word_embeddings: bool = True) -> int:
    """The parameter count from the sizes: a check that the model is built as the paper describes."""
    dec_layers = num_layers if num_decoder_layers is None else num_decoder_layers
    inner = num_heads * d_kv
    attn = 4 * d_model * inner  # q, k, v, o; no biases
    ff = (3 if feed_forward_proj.startswith("gated") else 2) * d_model * d_ff
    enc_block = attn + ff + 2 * d_model  # two norms
    dec_block = 2 * attn + ff + 3 * d_model  # self + cross attention, three norms
    stacks = num_layers * enc_block + dec_layers * dec_block + 2 * (num_buckets * num_heads + d_model)
    embeddings = vocab_size * d_model * (1 if tie_word_embeddings else 2)
    return stacks + embeddings
