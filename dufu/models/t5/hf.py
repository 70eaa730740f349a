"""Map dufu's T5 to and from Hugging Face transformers (``T5ForConditionalGeneration``, ``T5Model``,
``T5EncoderModel``).

The tensors are the same; only the names differ. transformers nests each sub-layer of a block in
``block.{i}.layer.{j}`` (j = 0 self-attention, 1 cross-attention in the decoder, last = feed-forward)
and keeps a stack's relative-bias table inside its first block; dufu names the parts
(``blocks.{i}.self_attn``, ``...cross_attn``, ``...mlp``) and keeps the table on the stack
(``encoder.relative_bias.table``). Hence one name table, built from the model, serves both directions.

Tying: transformers 5 always ties the head to the embedding unless a checkpoint holds a different
``lm_head.weight`` (T5 v1.1), and keeps the decoder-output rescale as ``scale_decoder_outputs``;
older configs say both with ``tie_word_embeddings``. Both spellings are read and written.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dufu.errors import DataError
from dufu.models.hub import StoredTensor

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
    from dufu.models.t5.model import T5EncoderModel

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
        "_tied_hf_keys": ["lm_head.weight"] if (head and tie) else [],
    }
    return cfg


def hf_name(name: str) -> str:
    """The transformers name of a dufu T5 tensor name."""
    if name == "wte.weight":
        return "shared.weight"
    if name == "lm_head.weight":
        return name
    m = re.fullmatch(r"(encoder|decoder)\.relative_bias\.table\.weight", name)
    if m:
        return f"{m[1]}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    m = re.fullmatch(r"(encoder|decoder)\.final_norm\.weight", name)
    if m:
        return f"{m[1]}.final_layer_norm.weight"
    m = re.fullmatch(r"(encoder|decoder)\.blocks\.(\d+)\.(\w+)\.?(\w*)\.weight", name)
    if not m:
        raise KeyError(f"no transformers name for T5 tensor {name!r}")
    stack, i, part, sub = m.groups()
    ff_layer = 2 if stack == "decoder" else 1
    prefix = f"{stack}.block.{i}.layer."
    if part == "ln_self":
        return prefix + "0.layer_norm.weight"
    if part == "ln_cross":
        return prefix + "1.layer_norm.weight"
    if part == "ln_mlp":
        return prefix + f"{ff_layer}.layer_norm.weight"
    if part == "self_attn":
        return prefix + f"0.SelfAttention.{_PROJ[sub]}.weight"
    if part == "cross_attn":
        return prefix + f"1.EncDecAttention.{_PROJ[sub]}.weight"
    if part == "mlp":
        return prefix + f"{ff_layer}.DenseReluDense.{_FF[sub]}.weight"
    raise KeyError(f"no transformers name for T5 tensor {name!r}")


def state_dict_from_hf(hf_sd, model) -> dict:
    """transformers T5 tensors (a dict or a lazy mapping) -> readers (zero-argument callables) of ``model``'s
    tensors, only those ``model`` holds. A checkpoint whose ``lm_head.weight`` differs from the embedding (T5
    v1.1 saved by a transformers that always claims tying) unties the model's head."""
    out = {}
    for name in model.state_dict():
        theirs = hf_name(name)
        if theirs in hf_sd:
            out[name] = StoredTensor(hf_sd, theirs)
    head = getattr(model, "lm_head", None)
    if head is None:
        return out
    if model.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # served by the embedding
        if "lm_head.weight" in hf_sd and not torch.equal(hf_sd["lm_head.weight"], hf_sd["shared.weight"]):
            if getattr(model, "wte", None) is None or type(head.weight) is not nn.Parameter:
                raise DataError(
                    "this T5 checkpoint's lm_head.weight differs from its embedding although the model ties them; "
                    "set model.tie_word_embeddings=False (a head of its own) to load it in a parallel layout.")
            model.untie_weights()  # a head of its own: filled from the checkpoint's
            out["lm_head.weight"] = StoredTensor(hf_sd, "lm_head.weight")
    elif "lm_head.weight" not in hf_sd:
        out["lm_head.weight"] = StoredTensor(hf_sd, "shared.weight")
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    out = {hf_name(name): t for name, t in sd.items()}
    # transformers also names the shared table inside each stack; they load as aliases of shared.weight
    return out


def _register() -> None:
    from dufu.models.hub import FamilyAdapter, register
    from dufu.models.t5.model import T5EncoderModel, T5ForConditionalGeneration, T5Model

    def encoder_model(**kw):
        keep = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "feed_forward_proj",
                "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate",
                "layer_norm_epsilon", "initializer_factor")
        return T5EncoderModel(**{k: v for k, v in kw.items() if k in keep})

    register(FamilyAdapter(
        model_type="t5",
        classes={
            "T5ForConditionalGeneration": T5ForConditionalGeneration,
            "T5Model": T5Model,
            "T5EncoderModel": encoder_model,
        },
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        state_dict_from_hf=state_dict_from_hf,
        state_dict_to_hf=state_dict_to_hf,
        default_architecture="T5ForConditionalGeneration",
        dufu_classes=(T5ForConditionalGeneration, T5EncoderModel),
        lazy=True,
    ))


_register()
