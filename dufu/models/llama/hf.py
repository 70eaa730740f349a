"""Map dufu's LlamaModel to and from Hugging Face transformers' ``LlamaForCausalLM`` and ``Qwen2ForCausalLM``.

Both store the same tensors under the same names (Qwen2 adds Q/K/V biases), and every dufu tensor is one
transformers tensor renamed — no splitting or transposing — so the mapping is a table of names only.

Rotary settings are read from transformers 5's ``rope_parameters`` as well as from the older
``rope_theta`` / ``rope_scaling`` keys, and written in both forms.
"""

from __future__ import annotations

from dufu.errors import DufuError
from dufu.models.hf_adapter import HFMapping
from dufu.models.hub import register
from dufu.models.llama.model import LlamaModel

# ----------------------------------------------------------------------------- config
def _rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    params = dict(hf.get("rope_parameters") or {})  # transformers >= 5
    legacy = hf.get("rope_scaling")  # older configs: rope_theta + rope_scaling
    if legacy and params.get("rope_type", params.get("type", "default")) == "default":
        params = {**params, **legacy}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
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


def config_from_hf(hf: dict) -> dict:
    """LlamaModel keyword arguments from a transformers LlamaConfig / Qwen2Config (as a dict)."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise DufuError(f"hidden_act {act!r} is not supported: dufu's LlamaModel uses SwiGLU (silu).")
    model_type = hf.get("model_type", "llama")
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        raise DufuError("Qwen2 with use_sliding_window=True is not supported (dufu attends to the full context).")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope_from_hf(hf)
    if model_type == "qwen2":
        qkv_bias, out_bias, mlp_bias = True, False, False
    else:
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        attention_dropout=hf.get("attention_dropout", 0.0),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        initializer_range=hf.get("initializer_range", 0.02),
    )


def hf_model_type(model) -> str:
    """"qwen2" for Q/K/V biases only, else "llama" (whose attention_bias covers Q, K, V and O alike)."""
    blk = model.blocks[next(iter(model.blocks))] if len(model.blocks) else None
    qkv = blk is not None and blk.attn.q_proj.bias is not None
    out = blk is not None and blk.attn.out_proj.bias is not None
    mlp = blk is not None and blk.mlp.gate_proj.bias is not None
    if qkv and not out and not mlp:
        return "qwen2"
    if qkv != out:
        raise DufuError("a LlamaModel with an output-projection bias but no Q/K/V biases has no transformers "
                        "counterpart (Llama biases all four projections, Qwen2 only Q/K/V).")
    return "llama"


def config_to_hf(model) -> dict:
    model_type = hf_model_type(model)
    blk = model.blocks[next(iter(model.blocks))] if len(model.blocks) else None
    eps = model.norm.eps if model.norm is not None else (blk.attn_norm.eps if blk is not None else 1e-6)
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling:
        rope = {**model.rope_scaling, "rope_theta": model.rope_theta}
        rope.setdefault("rope_type", rope.pop("type", "default"))
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": eps,
        "rope_parameters": rope,
        "rope_theta": model.rope_theta,  # older transformers read these two
        "rope_scaling": dict(rope) if model.rope_scaling else None,
        "attention_dropout": blk.attn.attention_dropout if blk is not None else 0.0,
        "tie_word_embeddings": model.tie_word_embeddings,
        "initializer_range": model.initializer_range,
        # dufu's tokenizers are not Llama's: no default BOS/EOS ids (transformers would assume 1 and 2)
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        cfg["attention_bias"] = blk is not None and blk.attn.q_proj.bias is not None
        cfg["mlp_bias"] = blk is not None and blk.mlp.gate_proj.bias is not None
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=model.num_layers,
                   layer_types=["full_attention"] * model.num_layers)
    return cfg


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
    ("blocks.{i}.mlp_norm", "model.layers.{i}.post_attention_layernorm"),
    ("blocks.{i}.mlp", "model.layers.{i}.mlp"),  # gate_proj, up_proj, down_proj: the same names
]

MAPPINGS = [
    register(HFMapping(
        model_type=model_type,
        classes={arch: LlamaModel},
        names=_NAMES,
        not_saved=(r"rotary\.inv_freq$",),  # recomputed from the config
        config_from_hf=lambda hf, mt=model_type: config_from_hf({**hf, "model_type": hf.get("model_type", mt)}),
        config_to_hf=config_to_hf,
        default_architecture=arch,
        dufu_classes=(LlamaModel,),
    ))
    for model_type, arch in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"))
]
