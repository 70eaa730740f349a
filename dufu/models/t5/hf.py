"""Map dufu's T5 to and from Hugging Face transformers (``T5ForConditionalGeneration``, ``T5Model``,
``T5EncoderModel``).

The tensors are the same; only the names differ. transformers nests each sub-layer of a block in
``block.{i}.layer.{j}`` (j = 0 self-attention, 1 cross-attention in the decoder, last = feed-forward)
and keeps a stack's relative-bias table inside its first block; dufu names the parts
(``blocks.{i}.self_attn``, ``...cross_attn``, ``...mlp``) and keeps the table on the stack
(``encoder.relative_bias.table``). Hence one name table serves both directions.

Tying: transformers 5 always ties the head to the embedding unless a checkpoint holds a different
``lm_head.weight`` (T5 v1.1), and keeps the decoder-output rescale as ``scale_decoder_outputs``;
older configs say both with ``tie_word_embeddings``. Both spellings are read and written.
"""

from __future__ import annotations

import torch
from torch import nn

from dufu.errors import DataError
from dufu.models.hf_adapter import ConfigField, HFConfigMap, HFMapping
from dufu.models.hf_weights import StoredTensor
from dufu.models.hub import register
from dufu.models.t5.model import T5EncoderModel, T5ForConditionalGeneration, T5Model

_PROJ = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "o"}
_FF = {"fc1": "wi", "fc2": "wo", "gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}


def _tie_to_hf(model) -> bool:
    """A model without a head of its own (no lm_head, or one tied to the embedding) is written as tied."""
    return bool(getattr(model, "tie_word_embeddings", True)) or getattr(model, "lm_head", None) is None


CONFIG = HFConfigMap(
    fields=[
        ConfigField("vocab_size", "vocab_size"),
        ConfigField("d_model", "d_model"),
        ConfigField("d_kv", "d_kv"),
        ConfigField("d_ff", "d_ff"),
        ConfigField("num_layers", "num_layers"),
        ConfigField("num_decoder_layers", "num_decoder_layers", default=lambda hf: hf["num_layers"], or_default=True,
                    export=lambda m: getattr(m, "num_decoder_layers", m.num_layers)),
        ConfigField("num_heads", "num_heads", export="num_attention_heads"),
        ConfigField("feed_forward_proj", "feed_forward_proj", default="relu",
                    from_hf={"relu": "relu", "gated-gelu": "gated-gelu"},
                    hint=" (dufu maps 'relu', T5, and 'gated-gelu', T5 v1.1)"),
        ConfigField("relative_attention_num_buckets", "relative_attention_num_buckets", default=32),
        ConfigField("relative_attention_max_distance", "relative_attention_max_distance", default=128),
        ConfigField("dropout_rate", "dropout_rate", default=0.1),
        ConfigField("layer_norm_epsilon", "layer_norm_epsilon", default=1e-6),
        ConfigField("initializer_factor", "initializer_factor", default=1.0),
        ConfigField(None, "is_encoder_decoder", load=False, export=lambda m: not isinstance(m, T5EncoderModel)),
        ConfigField("tie_word_embeddings", "tie_word_embeddings", default=True, export=_tie_to_hf),
        # transformers 5's key for the decoder-output rescale, which older configs say with tie_word_embeddings
        ConfigField("scale_decoder_outputs", "scale_decoder_outputs",
                    default=lambda hf: hf.get("tie_word_embeddings", True),
                    export=lambda m: bool(getattr(m, "scale_decoder_outputs", _tie_to_hf(m)))),
        ConfigField("pad_token_id", "pad_token_id", default=0, or_default=True,
                    export=lambda m: getattr(m, "pad_token_id", 0)),
        ConfigField("decoder_start_token_id", "decoder_start_token_id", default=None,
                    export=lambda m: getattr(m, "decoder_start_token_id", 0)),
    ],
    constants={"torch_dtype": "float32"},
)


def _stack_names(stack: str, ff_layer: int) -> list[tuple[str, str]]:
    """One stack's rows: transformers nests sub-layer j of block i as ``block.{i}.layer.{j}``."""
    b, h = f"{stack}.blocks.{{i}}", f"{stack}.block.{{i}}.layer"
    return [
        (f"{stack}.relative_bias.table", f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"),
        (f"{stack}.final_norm", f"{stack}.final_layer_norm"),
        (f"{b}.ln_self", f"{h}.0.layer_norm"),
        (f"{b}.ln_cross", f"{h}.1.layer_norm"),
        (f"{b}.ln_mlp", f"{h}.{ff_layer}.layer_norm"),
        *((f"{b}.self_attn.{ours}", f"{h}.0.SelfAttention.{theirs}") for ours, theirs in _PROJ.items()),
        *((f"{b}.cross_attn.{ours}", f"{h}.1.EncDecAttention.{theirs}") for ours, theirs in _PROJ.items()),
        *((f"{b}.mlp.{ours}", f"{h}.{ff_layer}.DenseReluDense.{theirs}") for ours, theirs in _FF.items()),
    ]


_NAMES = [
    ("wte", "shared"),
    ("lm_head.weight", ("lm_head.weight", "shared.weight")),  # an untied head missing: the embedding
    *_stack_names("encoder", 1),
    *_stack_names("decoder", 2),  # the decoder's feed-forward follows its cross-attention
]


def _finish_sources(hf_sd, model, out: dict) -> dict:
    """A tied head is served by the embedding, unless the checkpoint's ``lm_head.weight`` differs from it (T5
    v1.1 saved by a transformers that always claims tying): that unties the model's head."""
    head = getattr(model, "lm_head", None)
    if head is None or not model.tie_word_embeddings:
        return out
    out.pop("lm_head.weight", None)
    if "lm_head.weight" in hf_sd and not torch.equal(hf_sd["lm_head.weight"], hf_sd["shared.weight"]):
        if getattr(model, "wte", None) is None or type(head.weight) is not nn.Parameter:
            raise DataError(
                "this T5 checkpoint's lm_head.weight differs from its embedding although the model ties them; "
                "set model.tie_word_embeddings=False (a head of its own) to load it in a parallel layout.")
        model.untie_weights()  # a head of its own: filled from the checkpoint's
        out["lm_head.weight"] = StoredTensor(hf_sd, "lm_head.weight")
    return out


def _encoder_model(**kw):
    keep = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "feed_forward_proj",
            "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate",
            "layer_norm_epsilon", "initializer_factor")
    return T5EncoderModel(**{k: v for k, v in kw.items() if k in keep})


MAPPING = register(HFMapping(
    model_type="t5",
    classes={
        "T5ForConditionalGeneration": T5ForConditionalGeneration,
        "T5Model": T5Model,
        "T5EncoderModel": _encoder_model,
    },
    names=_NAMES,
    finish_sources=_finish_sources,
    config=CONFIG,
    default_architecture="T5ForConditionalGeneration",
    dufu_classes=(T5ForConditionalGeneration, T5EncoderModel),
))
