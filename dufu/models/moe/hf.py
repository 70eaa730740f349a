"""Map dufu's MoEModel to and from Hugging Face transformers' ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and
``Qwen3MoeForCausalLM``.

transformers 5 stores each block's experts as two grouped tensors, ``model.layers.N.mlp.experts.gate_up_proj``
(E, 2F, H: gate rows, then up rows) and ``...experts.down_proj`` (E, H, F), and the router as
``model.layers.N.mlp.gate.weight`` (E, H): the layout of :class:`dufu.layers.GroupedExperts`, so those are
renamed only. Qwen2-MoE adds ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate`` (1, H),
and its dense blocks keep ``mlp.{gate,up,down}_proj`` as Qwen2's do. Qwen3-MoE has Qwen2-MoE's layout without
the shared expert, and Qwen3's per-head ``self_attn.q_norm`` / ``k_norm``.

Directories written by earlier transformers versions (most published checkpoints) hold one tensor per expert:
Mixtral's ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) and ``block_sparse_moe.gate``,
Qwen2-MoE's ``mlp.experts.{e}.{gate,up,down}_proj``. Loading reads those too and stacks them into the grouped
layout (:func:`_per_expert_sources`); export always writes the grouped one.

Which transformers class a model exports as follows from it: query/key norms make it Qwen3-MoE, a gated shared
expert Qwen2-MoE, no shared expert Mixtral. A model none describes (a shared expert without a gate, Mixtral with
dense blocks or biases, Qwen3-MoE with a shared expert, ...) is refused with the reason. No config has a
sliding-window attention dufu could honour, so one is refused on load.
"""

from __future__ import annotations

from typing import Mapping

import torch

from dufu.errors import DufuError
from dufu.models.hf_adapter import ConfigField, HFConfigMap, HFMapping, UnsupportedHFValue, rope_to_hf
from dufu.models.hub import register
from dufu.models.llama.hf import refuse_sliding_window, rope_from_hf
from dufu.models.moe.model import MoEModel

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


# ----------------------------------------------------------------------------- config
def _mixtral_from_hf(hf: Mapping) -> dict:
    if hf.get("sliding_window") is not None:
        raise UnsupportedHFValue(f"Mixtral with sliding_window={hf['sliding_window']} is not supported (dufu's "
                                 "MoEModel attends to the full context); only sliding_window=null is.")
    if hf.get("router_jitter_noise"):
        raise UnsupportedHFValue(f"Mixtral with router_jitter_noise={hf['router_jitter_noise']} is not supported "
                                 "(dufu's router adds no noise); set it to 0.")
    ffn = hf["intermediate_size"]  # the experts' size: Mixtral has no dense blocks
    return dict(
        num_experts=hf.get("num_local_experts", hf.get("num_experts", 8)), ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn, norm_topk_prob=True, shared_ffn_hidden_size=None, shared_expert_gate=False,
        moe_layer_freq=1, mlp_only_layers=(), qkv_bias=False, out_bias=False,
    )


def _qwen2_moe_from_hf(hf: Mapping) -> dict:
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise UnsupportedHFValue("Qwen2-MoE with use_sliding_window=True (or sliding-attention layer_types) is not "
                                 "supported (dufu's MoEModel attends to the full context).")
    if not hf.get("num_experts", 60):
        raise UnsupportedHFValue("Qwen2-MoE with num_experts=0 has no experts; it is a dense model (load it as "
                                 "Qwen2 with dufu's LlamaModel).")
    shared = hf.get("shared_expert_intermediate_size", 5632)
    return dict(
        num_experts=hf.get("num_experts", 60), ffn_hidden_size=hf.get("intermediate_size", 5632),
        moe_ffn_hidden_size=hf.get("moe_intermediate_size", 1408), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        # transformers' Qwen2-MoE block always has a gated shared expert (size 0 adds nothing)
        shared_ffn_hidden_size=shared or None, shared_expert_gate=bool(shared),
        moe_layer_freq=hf.get("decoder_sparse_step", 1), mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        qkv_bias=bool(hf.get("qkv_bias", True)), out_bias=False,
    )


def _qwen3_moe_from_hf(hf: Mapping) -> dict:
    """Qwen3-MoE: Qwen3's attention (query/key norms, attention_bias on Q, K, V and O) with softmax top-k experts
    and no shared expert. Its config writes the expert count as num_local_experts (transformers 5's
    Qwen3MoeConfig) or num_experts (the published config.json files)."""
    refuse_sliding_window(hf, "Qwen3-MoE")
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    if not experts:
        raise UnsupportedHFValue("Qwen3-MoE with num_experts=0 has no experts; it is a dense model (load it as "
                                 "Qwen3 with dufu's LlamaModel).")
    attention = bool(hf.get("attention_bias", False))
    return dict(
        num_experts=experts, ffn_hidden_size=hf.get("intermediate_size", 6144),
        moe_ffn_hidden_size=hf.get("moe_intermediate_size", 768), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_ffn_hidden_size=None, shared_expert_gate=False,
        moe_layer_freq=hf.get("decoder_sparse_step", 1), mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        qkv_bias=attention, out_bias=attention, qk_norm=True,
    )


_FROM_HF = {"mixtral": _mixtral_from_hf, "qwen2_moe": _qwen2_moe_from_hf, "qwen3_moe": _qwen3_moe_from_hf}


def _more_from_hf(hf: Mapping) -> dict:
    """What a row cannot say: the experts' keys differ between the model types, and so do their checks."""
    mixtral = hf["model_type"] == "mixtral"
    kwargs = _FROM_HF[hf["model_type"]](hf)
    if mixtral and "rope_theta" not in hf and "rope_theta" not in (hf.get("rope_parameters") or {}):
        hf = {**hf, "rope_theta": 1000000.0}  # transformers' MixtralConfig.default_theta (Qwen2-MoE's is 1e4)
    theta, scaling = rope_from_hf(hf)
    return dict(kwargs, rope_theta=theta, rope_scaling=scaling, mlp_bias=False)


def _blocks(model: MoEModel) -> list:
    return list(model.blocks.values())


def hf_model_type(model: MoEModel) -> str:
    """"qwen3_moe" for query/key norms, "qwen2_moe" for a gated shared expert, "mixtral" for neither; a model none
    describes is a DufuError."""
    blocks = _blocks(model)
    dense = [b.mlp for b in blocks if not model.is_moe_layer(b.layer_idx)]
    dense_layers = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]  # a stage's or not
    reasons = []
    out_bias = bool(blocks) and blocks[0].attn.out_proj.bias is not None
    if out_bias and not (model.qk_norm and _qkv_bias(model)):
        reasons.append("an output-projection bias")
    if any(m.gate_proj.bias is not None for m in dense):
        reasons.append("MLP biases")
    if model.qk_norm:
        model_type = "qwen3_moe"
        if model.shared_ffn_hidden_size:
            reasons.append("a shared expert beside query/key norms (Qwen3-MoE has none)")
        if blocks and _qkv_bias(model) and not out_bias:
            reasons.append("Q/K/V biases without an output-projection bias (Qwen3-MoE's attention_bias has all four)")
    elif model.shared_ffn_hidden_size:
        if not model.shared_expert_gate:
            reasons.append("a shared expert without a gate (Qwen2-MoE always gates it)")
        model_type = "qwen2_moe"
    else:
        model_type = "mixtral"
        if dense_layers:
            reasons.append(f"dense blocks {dense_layers} (Mixtral's are all MoE blocks; Qwen2-MoE's need a gated "
                           "shared expert)")
        if not model.norm_topk_prob:
            reasons.append("norm_topk_prob=False (Mixtral always renormalises the top-k weights)")
        if blocks and _qkv_bias(model):
            reasons.append("Q/K/V biases without a shared expert")
    r = model.router_options
    if r["score_func"] != "softmax" or r["n_group"] > 1 or r["routed_scaling_factor"] != 1.0 or r["score_bias"]:
        reasons.append("DeepSeekMoE routing (score_func, n_group, routed_scaling_factor, score_bias): Mixtral, "
                       "Qwen2-MoE and Qwen3-MoE route by softmax top-k")
    if reasons:
        raise DufuError(f"this MoEModel has no transformers counterpart: {'; '.join(reasons)}. transformers' "
                        "Mixtral has no biases, no shared expert and experts in every block; its Qwen2-MoE has "
                        "Q/K/V biases, a gated shared expert in every MoE block and dense blocks where "
                        "(i + 1) % decoder_sparse_step != 0 or i in mlp_only_layers; its Qwen3-MoE has the same "
                        "blocks without the shared expert, query/key norms and biases on all of Q, K, V, O or none.")
    return model_type


def _more_to_hf(model: MoEModel) -> dict:
    """What a row cannot say: the experts pick the model_type (and its own keys); the rotary settings are
    written in both layouts transformers reads."""
    model_type = hf_model_type(model)
    cfg = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **rope_to_hf(model.rope_theta, model.rope_scaling),
        "output_router_logits": False,
    }
    if model_type == "mixtral":
        cfg.update(num_local_experts=model.num_experts, intermediate_size=model.moe_ffn_hidden_size,
                   sliding_window=None, router_jitter_noise=0.0)
    elif model_type == "qwen3_moe":
        cfg.update(
            num_experts=model.num_experts, intermediate_size=model.ffn_hidden_size,
            moe_intermediate_size=model.moe_ffn_hidden_size, norm_topk_prob=model.norm_topk_prob,
            decoder_sparse_step=model.moe_layer_freq, mlp_only_layers=list(model.mlp_only_layers),
            attention_bias=bool(_blocks(model)) and _qkv_bias(model), use_sliding_window=False, sliding_window=None,
        )
    else:
        cfg.update(
            num_experts=model.num_experts, intermediate_size=model.ffn_hidden_size,
            moe_intermediate_size=model.moe_ffn_hidden_size,
            shared_expert_intermediate_size=model.shared_ffn_hidden_size, norm_topk_prob=model.norm_topk_prob,
            decoder_sparse_step=model.moe_layer_freq, mlp_only_layers=list(model.mlp_only_layers),
            qkv_bias=_qkv_bias(model),
            use_sliding_window=False, sliding_window=None, max_window_layers=model.num_layers,
            layer_types=["full_attention"] * model.num_layers,
        )
    return cfg


def _qkv_bias(model) -> bool:
    blocks = _blocks(model)
    return blocks[0].attn.q_proj.bias is not None if blocks else True


def _norm_eps(model) -> float:
    """The final norm's epsilon; a pipeline stage without it reads a block's."""
    if model.norm is not None:
        return model.norm.eps
    blocks = _blocks(model)
    return blocks[0].attn_norm.eps if blocks else 1e-6


def _attention_dropout(model) -> float:
    blocks = _blocks(model)
    return blocks[0].attn.attention_dropout if blocks else 0.0


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
        ConfigField(None, "hidden_act", default=None, from_hf={"silu": "silu", "swish": "silu"},
                    hint=": dufu's MoEModel uses SwiGLU (silu) experts", export=lambda m: "silu"),
        ConfigField("top_k", "num_experts_per_tok", default=2),
        ConfigField("aux_loss_coeff", "router_aux_loss_coef", default=0.001),
        ConfigField("max_position_embeddings", "max_position_embeddings", default=4096),
        ConfigField("rms_norm_eps", "rms_norm_eps", default=1e-6, export=_norm_eps),
        ConfigField("attention_dropout", "attention_dropout", default=0.0, export=_attention_dropout),
        ConfigField("tie_word_embeddings", "tie_word_embeddings", default=False),
        ConfigField("initializer_range", "initializer_range", default=0.02),
    ],
    constants={
        # dufu's tokenizers are not Mixtral's: no default BOS/EOS ids (transformers would assume 1 and 2)
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
    ("blocks.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_norm"),  # Qwen3-MoE
    ("blocks.{i}.attn.k_norm", "model.layers.{i}.self_attn.k_norm"),
    ("blocks.{i}.mlp_norm", "model.layers.{i}.post_attention_layernorm"),
    ("blocks.{i}.mlp.router", "model.layers.{i}.mlp.gate"),
    ("blocks.{i}.mlp.experts", "model.layers.{i}.mlp.experts"),  # gate_up_proj, down_proj: grouped, as-is
    ("blocks.{i}.mlp.shared_gate", "model.layers.{i}.mlp.shared_expert_gate"),
    ("blocks.{i}.mlp.shared", "model.layers.{i}.mlp.shared_expert"),
    ("blocks.{i}.mlp", "model.layers.{i}.mlp"),  # a dense block: gate_proj, up_proj, down_proj
]

# Per-expert names of earlier transformers versions: (gate, up, down) under model.layers.{i}.
_PER_EXPERT = (
    ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
     "block_sparse_moe.experts.{e}.w2.weight"),  # Mixtral
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
)


def _stacked(hf: Mapping, keys: list, concat: list | None = None):
    """A reader of ``hf[keys[e]]`` stacked over experts e, each concatenated with ``hf[concat[e]]`` first."""
    def read() -> torch.Tensor:
        if concat is None:
            return torch.stack([hf[k] for k in keys])  # (E, H, F)
        return torch.stack([torch.cat([hf[g], hf[u]]) for g, u in zip(keys, concat)])  # (E, 2F, H): gate | up
    return read


def _per_expert_sources(hf: Mapping, model: MoEModel, out: dict) -> dict:
    """Grouped expert tensors the directory stores one per expert (earlier transformers versions)."""
    for name in model.state_dict():
        if name in out or not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            continue
        i = name.split(".")[1]
        for gate, up, down in _PER_EXPERT:
            keys = [[f"model.layers.{i}.{p.format(e=e)}" for e in range(model.num_experts)] for p in (gate, up, down)]
            if all(k in hf for k in keys[0]):
                out[name] = _stacked(hf, keys[0], keys[1]) if name.endswith("gate_up_proj") else _stacked(hf, keys[2])
                break
    return out


MAPPINGS = [
    register(HFMapping(
        model_type=model_type,
        classes={arch: MoEModel},
        names=_NAMES,
        load_renames=((r"\.block_sparse_moe\.gate\.", ".mlp.gate."),),  # Mixtral's router before transformers 5
        not_saved=(r"rotary\.inv_freq$",),  # recomputed from the config
        config=CONFIG,
        finish_sources=_per_expert_sources,
        default_architecture=arch,
        dufu_classes=(MoEModel,),
    ))
    for model_type, arch in ARCHITECTURES.items()
]
