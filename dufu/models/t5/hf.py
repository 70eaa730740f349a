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
from dufu.models.hf_adapter import HFMapping
from dufu.models.hub import StoredTensor, register
from dufu.models.t5.model import T5EncoderModel, T5ForConditionalGeneration, T5Model

_PROJ = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "o"}
_FF = {"fc1": "wi", "fc2": "wo", "gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}


def config_from_hf(hf: dict) -> dict:
    """T5Model keyword arguments from a transformers T5Config (as a dict)."""
    ff = hf.get("feed_forward_proj", "relu")
    if ff not in ("relu", "gated-gelu"):
        raise ValueError(f"T5 feed_forward_proj {ff!r} is not supported; dufu maps 'relu' (T5) and 'gated-gelu' (T5 v1.1)")
    tie = hf.get("tie_word_embeddings", True)
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["d_model"],
        d_kv=hf["d_kv"],
        d_ff=hf["d_ff"],
        num_layers=hf["num_layers"],
        num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        num_heads=hf["num_heads"],
        feed_forward_proj=ff,
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        dropout_rate=hf.get("dropout_rate", 0.1),
        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-6),
        tie_word_embeddings=tie,
        scale_decoder_outputs=hf.get("scale_decoder_outputs", tie),
        pad_token_id=hf.get("pad_token_id", 0) or 0,
        decoder_start_token_id=hf.get("decoder_start_token_id"),
        initializer_factor=hf.get("initializer_factor", 1.0),
    )


def config_to_hf(model) -> dict:
    encoder_only = isinstance(model, T5EncoderModel)
    head = getattr(model, "lm_head", None) is not None
    arch = "T5EncoderModel" if encoder_only else ("T5ForConditionalGeneration" if head else "T5Model")
    tie = bool(getattr(model, "tie_word_embeddings", True)) or not head
    cfg = {
        "architectures": [arch],
        "model_type": "t5",
        "vocab_size": model.vocab_size,
        "d_model": model.d_model,
        "d_kv": model.d_kv,
        "d_ff": model.d_ff,
        "num_layers": model.num_layers,
        "num_decoder_layers": getattr(model, "num_decoder_layers", model.num_layers),
        "num_heads": model.num_attention_heads,
        "feed_forward_proj": model.feed_forward_proj,
        "relative_attention_num_buckets": model.relative_attention_num_buckets,
        "relative_attention_max_distance": model.relative_attention_max_distance,
        "dropout_rate": model.dropout_rate,
        "layer_norm_epsilon": model.layer_norm_epsilon,
        "initializer_factor": model.initializer_factor,
        "is_encoder_decoder": not encoder_only,
        "tie_word_embeddings": tie,
        "scale_decoder_outputs": bool(getattr(model, "scale_decoder_outputs", tie)),
        "pad_token_id": getattr(model, "pad_token_id", 0),
        "decoder_start_token_id": getattr(model, "decoder_start_token_id", 0),
        "torch_dtype": "float32",
    }
    return cfg


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
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    default_architecture="T5ForConditionalGeneration",
    dufu_classes=(T5ForConditionalGeneration, T5EncoderModel),
))
