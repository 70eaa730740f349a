"""Map dufu's LlamaModel to and from Hugging Face transformers' ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM``.

All three store the same tensors under the same names (Qwen2 adds Q/K/V biases, Qwen3 the per-head
``self_attn.q_norm`` / ``k_norm`` weights of ``head_dim``), and every dufu tensor is one transformers tensor
renamed — no splitting or transposing — so the mapping is a table of names only. Which one a model exports as
follows from it: the query/key norms make it Qwen3 (whose ``attention_bias`` covers Q, K, V and O, as Llama's
does), Q/K/V biases alone Qwen2, anything else Llama. Qwen2's and Qwen3's sliding-window attention is refused.

Rotary settings are read from transformers 5's ``rope_parameters`` as well as from the older
``rope_theta`` / ``rope_scaling`` keys, and written in both forms.
"""

from __future__ import annotations

from dufu.errors import DufuError
from dufu.models.hf_adapter import (ConfigField, HFConfigMap, HFMapping, in_first_block, rope_parameters,
                                   rope_to_hf)
from dufu.models.hub import register
from dufu.models.llama.model import LlamaModel

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


# ----------------------------------------------------------------------------- config
def rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) for dufu's LlamaModel: default, llama3 and linear scaling."""
    theta, kind, params = rope_parameters(hf)
    if kind == "default":
        return float(theta), None
    if kind == "llama3":
        return float(theta), {
            "rope_type": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
            # transformers falls back to max_position_embeddings when the original length is not given
            "original_max_position_embeddings": int(params.get("original_max_position_embeddings",
                                                               hf.get("max_position_embeddings", 8192))),
        }
    if kind == "linear":
        return float(theta), {"rope_type": "linear", "factor": float(params["factor"])}
    raise DufuError(f"rotary scaling {kind!r} is not supported by dufu's LlamaModel; supported: default, llama3, "
                    "linear.")


def refuse_sliding_window(hf: dict, family: str) -> None:
    """A Qwen config with sliding-window attention (``use_sliding_window``, or sliding layers in ``layer_types``)
    is refused: dufu's decoders attend to the full context."""
    sliding = [i for i, t in enumerate(hf.get("layer_types") or ()) if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        where = f" (layers {sliding} of layer_types)" if sliding else ""
        raise DufuError(f"{family} with use_sliding_window=True or sliding-attention layer_types{where} is not "
                        "supported (dufu attends to the full context); set use_sliding_window=false.")


def _more_from_hf(hf: dict) -> dict:
    """What a row cannot say: Qwen2's and Qwen3's sliding window is refused, Qwen2's biases follow from the
    model_type (Q/K/V only) while Llama's come from two keys and Qwen3's from attention_bias (Q, K, V and O),
    Qwen3 normalises queries and keys, and the rotary settings come from one of two layouts."""
    model_type, extra = hf["model_type"], {}
    if model_type == "qwen2":
        if hf.get("use_sliding_window"):
            raise DufuError("Qwen2 with use_sliding_window=True is not supported (dufu attends to the full context).")
        biases = dict(qkv_bias=True, out_bias=False, mlp_bias=False)
    elif model_type == "qwen3":
        refuse_sliding_window(hf, "Qwen3")
        attention = bool(hf.get("attention_bias", False))
        biases = dict(qkv_bias=attention, out_bias=attention, mlp_bias=False)
        # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / num_attention_heads
        extra = dict(qk_norm=True, head_dim=hf.get("head_dim") or 128)
    else:
        attention = bool(hf.get("attention_bias", False))
        biases = dict(qkv_bias=attention, out_bias=attention, mlp_bias=bool(hf.get("mlp_bias", False)))
    theta, scaling = rope_from_hf(hf)
    return dict(rope_theta=theta, rope_scaling=scaling, **biases, **extra)


def hf_model_type(model) -> str:
    """"qwen3" for query/key norms, "qwen2" for Q/K/V biases only, else "llama" (whose attention_bias covers Q, K,
    V and O alike, as Qwen3's does)."""
    blk = model.blocks[next(iter(model.blocks))] if len(model.blocks) else None
    qkv = blk is not None and blk.attn.q_proj.bias is not None
    out = blk is not None and blk.attn.out_proj.bias is not None
    mlp = blk is not None and blk.mlp.gate_proj.bias is not None
    if model.qk_norm:
        if qkv != out or mlp:
            raise DufuError("a LlamaModel with qk_norm has a transformers counterpart (Qwen3) only without MLP biases "
                            "and with either biases on all of Q, K, V and O or on none (Qwen3's attention_bias).")
        return "qwen3"
    if qkv and not out and not mlp:
        return "qwen2"
    if qkv != out:
        raise DufuError("a LlamaModel with an output-projection bias but no Q/K/V biases has no transformers "
                        "counterpart (Llama biases all four projections, Qwen2 only Q/K/V).")
    return "llama"


def _more_to_hf(model) -> dict:
    """What a row cannot say: the biases pick the model_type (and so the architecture and its own keys), and
    the rotary settings are written in both layouts."""
    model_type = hf_model_type(model)
    cfg = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **rope_to_hf(model.rope_theta, model.rope_scaling),
    }
    if model_type == "llama":
        cfg["attention_bias"] = in_first_block("attn.q_proj.bias")(model) is not None
        cfg["mlp_bias"] = in_first_block("mlp.gate_proj.bias")(model) is not None
    else:
        if model_type == "qwen3":
            cfg["attention_bias"] = in_first_block("attn.q_proj.bias")(model) is not None
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=model.num_layers,
                   layer_types=["full_attention"] * model.num_layers)
    return cfg


def _norm_eps(model) -> float:
    """The final norm's epsilon; a pipeline stage without it reads a block's."""
    if model.norm is not None:
        return model.norm.eps
    return in_first_block("attn_norm.eps", 1e-6)(model)


CONFIG = HFConfigMap(
    fields=[
        ConfigField("vocab_size", "vocab_size"),
        ConfigField("hidden_size", "hidden_size"),
        ConfigField("num_layers", "num_hidden_layers"),
        ConfigField("num_attention_heads", "num_attention_heads"),
        ConfigField("num_key_value_heads", "num_key_value_heads", default=lambda hf: hf["num_attention_heads"],
                    or_default=True),
        ConfigField("head_dim", "head_dim", default=lambda hf: hf["hidden_size"] // hf["num_attention_heads"],
                    or_default=True),
        ConfigField("ffn_hidden_size", "intermediate_size"),
        ConfigField(None, "hidden_act", default=None, from_hf={"silu": "silu", "swish": "silu"},
                    hint=": dufu's LlamaModel uses SwiGLU (silu)", export=lambda m: "silu"),
        ConfigField("max_position_embeddings", "max_position_embeddings", default=2048),
        ConfigField("rms_norm_eps", "rms_norm_eps", default=1e-6, export=_norm_eps),
        ConfigField("attention_dropout", "attention_dropout", default=0.0,
                    export=in_first_block("attn.attention_dropout", 0.0)),
        ConfigField("tie_word_embeddings", "tie_word_embeddings", default=False),
        ConfigField("initializer_range", "initializer_range", default=0.02),
    ],
    constants={
        # dufu's tokenizers are not Llama's: no default BOS/EOS ids (transformers would assume 1 and 2)
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",
    },
    more_from_hf=_more_from_hf,
    more_to_hf=_more_to_hf,
)


# ----------------------------------------------------------------------------- tensors
_NAMES = [
    ("wte", "model.embed_tokens"),
    ("norm", "model.norm"),
    ("lm_head.weight", ("lm_head.weight", "model.embed_tokens.weight")),  # a tied head: the embedding
    ("blocks.{i}.attn_norm", "model.layers.{i}.input_layernorm"),
    ("blocks.{i}.attn.q_proj", "model.layers.{i}.self_attn.q_proj"),
    ("blocks.{i}.attn.k_proj", "model.layers.{i}.self_attn.k_proj"),
    ("blocks.{i}.attn.v_proj", "model.layers.{i}.self_attn.v_proj"),
    ("blocks.{i}.attn.out_proj", "model.layers.{i}.self_attn.o_proj"),
    ("blocks.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_norm"),  # Qwen3
    ("blocks.{i}.attn.k_norm", "model.layers.{i}.self_attn.k_norm"),
    ("blocks.{i}.mlp_norm", "model.layers.{i}.post_attention_layernorm"),
    ("blocks.{i}.mlp", "model.layers.{i}.mlp"),  # gate_proj, up_proj, down_proj: the same names
]

MAPPINGS = [
    register(HFMapping(
        model_type=model_type,
        classes={arch: LlamaModel},
        names=_NAMES,
        not_saved=(r"rotary\.inv_freq$",),  # recomputed from the config
        config=CONFIG,
        default_architecture=arch,
        dufu_classes=(LlamaModel,),
    ))
    for model_type, arch in ARCHITECTURES.items()
]
