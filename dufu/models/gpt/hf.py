"""Map dufu's GPTModel to and from Hugging Face transformers' GPT-2 (``GPT2LMHeadModel``).

transformers' GPT-2 stores its projections as ``Conv1D`` with weights laid out
(in_features, out_features) — the transpose of ``nn.Linear`` — and fuses Q, K, V
into one ``c_attn`` matrix. dufu keeps separate q/k/v projections (so tensor
parallelism splits whole heads), hence the split and concatenation below.
"""

from __future__ import annotations

import torch

_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
_ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                "silu": "silu", "swish": "silu"}


def config_from_hf(hf: dict) -> dict:
    """GPTModel keyword arguments from a transformers GPT2Config (as a dict)."""
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACT_FROM_HF:
        raise ValueError(f"GPT-2 activation_function {act!r} is not supported; known: {sorted(_ACT_FROM_HF)}")
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["n_embd"],
        num_layers=hf["n_layer"],
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
        max_position_embeddings=hf["n_positions"],
        embedding_dropout=hf.get("embd_pdrop", 0.0),
        hidden_dropout=hf.get("resid_pdrop", 0.0),
        attention_dropout=hf.get("attn_pdrop", 0.0),
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        activation=_ACT_FROM_HF[act],
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        initializer_range=hf.get("initializer_range", 0.02),
    )


def config_to_hf(model) -> dict:
    ffn = model.blocks["0"].mlp.fc1.out_features if len(model.blocks) else 4 * model.hidden_size
    act = model.blocks["0"].mlp.activation if len(model.blocks) else "gelu_tanh"
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_embd": model.hidden_size,
        "n_layer": model.num_layers,
        "n_head": model.num_attention_heads,
        "n_inner": ffn,
        "n_positions": model.max_position_embeddings,
        "n_ctx": model.max_position_embeddings,
        "activation_function": _ACT_TO_HF[act],
        "layer_norm_epsilon": model.ln_f.eps,
        "initializer_range": model.initializer_range,
        "tie_word_embeddings": model.tie_word_embeddings,
        "embd_pdrop": model.drop.p,
        "resid_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "torch_dtype": "float32",
    }


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """transformers GPT-2 tensors (with or without the ``transformer.`` prefix) -> GPTModel tensors."""
    sd = {k.removeprefix("transformer."): v for k, v in hf_sd.items()}
    out = {"wte.weight": sd["wte.weight"], "wpe.weight": sd["wpe.weight"],
           "ln_f.weight": sd["ln_f.weight"], "ln_f.bias": sd["ln_f.bias"]}
    out["lm_head.weight"] = hf_sd.get("lm_head.weight", sd["wte.weight"])
    for i in range(num_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[b + ours + ".weight"] = sd[h + theirs + ".weight"]
            out[b + ours + ".bias"] = sd[h + theirs + ".bias"]
        q, k, v = sd[h + "attn.c_attn.weight"].t().chunk(3, dim=0)  # (3C, C) -> 3 x (C, C)
        qb, kb, vb = sd[h + "attn.c_attn.bias"].chunk(3)
        for name, w, bias in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
            out[b + f"attn.{name}.weight"] = w.contiguous()
            out[b + f"attn.{name}.bias"] = bias
        for ours, theirs in (("attn.out_proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            out[b + ours + ".weight"] = sd[h + theirs + ".weight"].t().contiguous()
            out[b + ours + ".bias"] = sd[h + theirs + ".bias"]
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """GPTModel tensors -> transformers ``GPT2LMHeadModel`` tensors."""
    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"], "transformer.ln_f.bias": sd["ln_f.bias"],
           "lm_head.weight": sd.get("lm_head.weight", sd["wte.weight"])}
    for i in range(num_layers):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[h + theirs + ".weight"] = sd[b + ours + ".weight"]
            out[h + theirs + ".bias"] = sd[b + ours + ".bias"]
        qkv = torch.cat([sd[b + f"attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")], dim=0)  # (3C, C)
        out[h + "attn.c_attn.weight"] = qkv.t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat([sd[b + f"attn.{n}.bias"] for n in ("q_proj", "k_proj", "v_proj")])
        for ours, theirs in (("attn.out_proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            out[h + theirs + ".weight"] = sd[b + ours + ".weight"].t().contiguous()
            out[h + theirs + ".bias"] = sd[b + ours + ".bias"]
    return out


def _register() -> None:
    from dufu.models.gpt.model import GPTModel
    from dufu.models.hub import FamilyAdapter, register

    def to_hf_config(model) -> dict:
        cfg = config_to_hf(model)
        cfg["_tied_hf_keys"] = ["lm_head.weight"] if model.tie_word_embeddings else []
        return cfg

    register(FamilyAdapter(
        model_type="gpt2",
        classes={"GPT2LMHeadModel": GPTModel},
        config_from_hf=config_from_hf,
        config_to_hf=to_hf_config,
        state_dict_from_hf=lambda sd, model: state_dict_from_hf(sd, model.num_layers),
        state_dict_to_hf=lambda sd, model: state_dict_to_hf(sd, model.num_layers),
        default_architecture="GPT2LMHeadModel",
        dufu_classes=(GPTModel,),
    ))


_register()
