"""Map dufu's DeepseekV3Model to and from Hugging Face transformers' ``DeepseekV3ForCausalLM``.

Every tensor is one transformers tensor renamed: MLA's ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` /
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; a MoE block's router
``mlp.gate.weight`` (E, H), its choice bias ``mlp.gate.e_score_correction_bias`` (E,) (dufu's
``mlp.score_bias``), the grouped experts ``mlp.experts.gate_up_proj`` (E, 2F, H) / ``down_proj`` (E, H, F) and
``mlp.shared_experts.*``; a dense block's ``mlp.{gate,up,down}_proj``. Checkpoints that store one tensor per
expert (DeepSeek's own, transformers before 5) are stacked on load as for Mixtral
(:func:`_per_expert_sources`).

Multi-token prediction modules are stored as DeepSeek's checkpoints store them, as extra layers after the main
model's L: MTP depth k (dufu's ``mtp.{k-1}``) is ``model.layers.{L+k-1}``, with ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` (dufu's ``mtp.{k-1}.norm``) and a decoder layer's tensors (its block); the
embedding and head it shares are not written again (DeepSeek's checkpoint repeats them as ``embed_tokens`` and
``shared_head.head``; transformers' ``MtpModel`` takes the main model's). transformers' DeepseekV3ForCausalLM
builds ``num_hidden_layers`` layers and leaves those tensors aside on load. Loading builds no MTP modules
(``mtp_depth`` 0) whatever ``num_nextn_predict_layers`` says (transformers' default config says 1 for a model that
has none): a run sets ``model.mtp_depth`` to read them (DeepSeek-V3: 1, ``model.layers.61``) or, from a checkpoint
without them, to train new ones.
"""

from __future__ import annotations

from typing import Mapping

import torch

from dufu.models.deepseek.model import DeepseekV3Model
from dufu.models.hf_adapter import ConfigField, HFConfigMap, HFMapping, UnsupportedHFValue, rope_parameters, rope_to_hf
from dufu.models.hub import register

ROPE_TYPES = ("default", "yarn", "linear", "llama3")


# ----------------------------------------------------------------------------- config
def rope_from_hf(hf: Mapping) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` / ``rope_scaling`` keys."""
    theta, kind, params = rope_parameters(hf)
    if kind not in ROPE_TYPES:
        raise UnsupportedHFValue(f"rotary scaling {kind!r} is not supported by dufu's MLA; supported: "
                                 f"{', '.join(ROPE_TYPES)}.")
    return theta, (None if kind == "default" else {"rope_type": kind, **params})


def _more_from_hf(hf: Mapping) -> dict:
    heads = hf.get("num_attention_heads", 128)
    if hf.get("num_key_value_heads") not in (None, heads):
        raise UnsupportedHFValue(f"DeepSeek-V3 with num_key_value_heads {hf['num_key_value_heads']} != "
                                 f"num_attention_heads {heads}: MLA expands every head's key and value from the "
                                 "latent, so transformers' grouped-query setting has no counterpart in dufu.")
    if hf.get("pretraining_tp", 1) not in (None, 1):
        raise UnsupportedHFValue("pretraining_tp != 1 is not supported; the weights are the same, set it to 1.")
    theta, scaling = rope_from_hf(hf)
    return dict(rope_theta=theta, rope_scaling=scaling, score_func="sigmoid", score_bias=True, mtp_depth=0)


def _more_to_hf(model: DeepseekV3Model) -> dict:
    blocks = list(model.blocks.values())
    moe = [b.mlp for b in blocks if b.layer_idx >= model.first_k_dense]
    if moe and (moe[0].score_func != "sigmoid" or moe[0].score_bias is None or moe[0].capacity_factor is not None):
        raise UnsupportedHFValue("transformers' DeepseekV3 routes by sigmoid scores with a choice bias, dropless: "
                                 "this model's MoE layers (score_func, score_bias, capacity_factor) differ.")
    return {
        **rope_to_hf(model.rope_theta, model.rope_scaling),
        "num_key_value_heads": model.num_attention_heads,
        "num_nextn_predict_layers": model.mtp_depth,
    }


CONFIG = HFConfigMap(
    fields=[
        ConfigField("vocab_size", "vocab_size"),
        ConfigField("hidden_size", "hidden_size"),
        ConfigField("num_layers", "num_hidden_layers"),
        ConfigField("num_attention_heads", "num_attention_heads"),
        ConfigField("q_lora_rank", "q_lora_rank", default=1536),
        ConfigField("kv_lora_rank", "kv_lora_rank", default=512),
        ConfigField("qk_nope_head_dim", "qk_nope_head_dim", default=128),
        ConfigField("qk_rope_head_dim", "qk_rope_head_dim", default=64),
        ConfigField("v_head_dim", "v_head_dim", default=128),
        ConfigField("ffn_hidden_size", "intermediate_size", default=18432),
        ConfigField("moe_ffn_hidden_size", "moe_intermediate_size", default=2048),
        ConfigField("first_k_dense", "first_k_dense_replace", default=3),
        ConfigField("num_experts", "n_routed_experts", default=256),
        ConfigField("top_k", "num_experts_per_tok", default=8),
        ConfigField("num_shared_experts", "n_shared_experts", default=1),
        ConfigField("n_group", "n_group", default=8),
        ConfigField("topk_group", "topk_group", default=4),
        ConfigField("routed_scaling_factor", "routed_scaling_factor", default=2.5),
        ConfigField("norm_topk_prob", "norm_topk_prob", default=True),
        ConfigField(None, "hidden_act", default="silu", from_hf={"silu": "silu", "swish": "silu"},
                    hint=": dufu's DeepSeek-V3 uses SwiGLU (silu)", export=lambda m: "silu"),
        ConfigField("max_position_embeddings", "max_position_embeddings", default=4096),
        ConfigField("rms_norm_eps", "rms_norm_eps", default=1e-6),
        ConfigField("rope_interleave", "rope_interleave", default=True),
        ConfigField("attention_bias", "attention_bias", default=False),
        ConfigField("attention_dropout", "attention_dropout", default=0.0),
        ConfigField("tie_word_embeddings", "tie_word_embeddings", default=False),
        ConfigField("initializer_range", "initializer_range", default=0.02),
    ],
    constants={
        # dufu's tokenizers are not DeepSeek's: no default BOS/EOS ids (transformers would assume 0 and 1)
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",
    },
    more_from_hf=_more_from_hf,
    more_to_hf=_more_to_hf,
)


# ----------------------------------------------------------------------------- tensors
_MTP_NAMES = [  # before the blocks' rows: an MTP depth's block is named like a main block, at layer {j}
    ("mtp.{k}.enorm", "model.layers.{j}.enorm"),
    ("mtp.{k}.hnorm", "model.layers.{j}.hnorm"),
    ("mtp.{k}.eh_proj", "model.layers.{j}.eh_proj"),
    ("mtp.{k}.norm", "model.layers.{j}.shared_head.norm"),
]
_BLOCK_NAMES = [
    ("attn_norm", "input_layernorm"),
    ("attn.q_proj", "self_attn.q_proj"),
    ("attn.q_a_proj", "self_attn.q_a_proj"),
    ("attn.q_a_norm", "self_attn.q_a_layernorm"),
    ("attn.q_b_proj", "self_attn.q_b_proj"),
    ("attn.kv_a_proj", "self_attn.kv_a_proj_with_mqa"),
    ("attn.kv_a_norm", "self_attn.kv_a_layernorm"),
    ("attn.kv_b_proj", "self_attn.kv_b_proj"),
    ("attn.out_proj", "self_attn.o_proj"),
    ("mlp_norm", "post_attention_layernorm"),
    ("mlp.router", "mlp.gate"),
    ("mlp.score_bias", "mlp.gate.e_score_correction_bias"),
    ("mlp.experts", "mlp.experts"),  # gate_up_proj, down_proj: grouped, as-is
    ("mlp.shared", "mlp.shared_experts"),
    ("mlp", "mlp"),  # a dense block: gate_proj, up_proj, down_proj
]
_NAMES = [
    ("wte", "model.embed_tokens"),
    ("norm", "model.norm"),
    ("lm_head.weight", ("lm_head.weight", "model.embed_tokens.weight")),  # a tied head: the embedding
    *_MTP_NAMES,
    *[(f"blocks.{{i}}.{ours}", f"model.layers.{{i}}.{theirs}") for ours, theirs in _BLOCK_NAMES],
    *[(f"mtp.{{k}}.block.{ours}", f"model.layers.{{j}}.{theirs}") for ours, theirs in _BLOCK_NAMES],
]


def _mtp_layer(model: DeepseekV3Model, values: dict) -> dict:
    """``{j}``: the checkpoint layer of MTP depth ``{k}`` (0-based), after the main model's layers."""
    return {"j": model.num_layers + int(values["k"])} if "k" in values else {}


def _per_expert_sources(hf: Mapping, model: DeepseekV3Model, out: dict) -> dict:
    """Grouped expert tensors a checkpoint stores one per expert: ``mlp.experts.{e}.{gate,up,down}_proj.weight``
    stacked into (E, 2F, H) (gate rows, then up rows) and (E, H, F)."""
    for name in model.state_dict():
        if name in out or ".mlp.experts." not in name or not name.endswith((".gate_up_proj", ".down_proj")):
            continue
        index = int(name.split(".")[1])  # blocks.{i}... or mtp.{k}...: checkpoint layer i or L + k
        layer = index if name.startswith("blocks.") else model.num_layers + index
        prefix = f"model.layers.{layer}.mlp.experts"
        keys = {p: [f"{prefix}.{e}.{p}.weight" for e in range(model.num_experts)]
                for p in ("gate_proj", "up_proj", "down_proj")}
        if not all(k in hf for k in keys["gate_proj"]):
            continue
        if name.endswith("gate_up_proj"):
            out[name] = lambda keys=keys: torch.stack(
                [torch.cat([hf[g], hf[u]]) for g, u in zip(keys["gate_proj"], keys["up_proj"])])  # (E, 2F, H)
        else:
            out[name] = lambda keys=keys: torch.stack([hf[d] for d in keys["down_proj"]])  # (E, H, F)
    return out


MAPPING = register(HFMapping(
    model_type="deepseek_v3",
    classes={"DeepseekV3ForCausalLM": DeepseekV3Model},
    names=_NAMES,
    not_saved=(r"rotary\.inv_freq$",),  # recomputed from the config
    placeholders=_mtp_layer,
    config=CONFIG,
    finish_sources=_per_expert_sources,
    default_architecture="DeepseekV3ForCausalLM",
    dufu_classes=(DeepseekV3Model,),
))
