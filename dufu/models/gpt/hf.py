"""Map dufu's GPTModel to and from Hugging Face transformers' GPT-2 (``GPT2LMHeadModel``).

transformers' GPT-2 stores its projections as ``Conv1D`` with weights laid out
(in_features, out_features) — the transpose of ``nn.Linear`` — and fuses Q, K, V
into one ``c_attn`` matrix. dufu keeps separate q/k/v projections (so tensor
parallelism splits whole heads), hence the split and concatenation below.
"""

from __future__ import annotations

import torch

from dufu.models.hub import StoredTensor

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


def _hf_key(hf, name: str) -> str:
    """The stored name of a ``transformer.*`` tensor (saved with or without the prefix)."""
    return name if name in hf else name.removeprefix("transformer.")


def tensor_sources(hf, keys) -> dict:
    """For each GPTModel tensor name in ``keys``: a zero-argument callable that reads it from the transformers
    GPT-2 tensors ``hf`` (a dict or a lazy mapping; only what is called is read)."""
    out = {}
    for key in keys:
        parts = key.split(".")
        if key == "lm_head.weight":
            theirs = "lm_head.weight" if "lm_head.weight" in hf else _hf_key(hf, "transformer.wte.weight")
            out[key] = StoredTensor(hf, theirs)
        elif parts[0] in ("wte", "wpe", "ln_f"):
            out[key] = StoredTensor(hf, _hf_key(hf, "transformer." + key))
        elif parts[0] == "blocks":
            i, module, rest = parts[1], ".".join(parts[2:-1]), parts[-1]  # e.g. "3", "attn.q_proj", "weight"
            h = f"transformer.h.{i}."
            if module in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
                # c_attn is a Conv1D: weight (C, 3C) with q | k | v along the output (second) dim
                which = ("attn.q_proj", "attn.k_proj", "attn.v_proj").index(module)
                theirs = _hf_key(hf, h + "attn.c_attn." + rest)
                if rest == "weight":
                    out[key] = lambda t=theirs, w=which: hf[t].t().chunk(3, dim=0)[w].contiguous()  # (C, C)
                else:
                    out[key] = lambda t=theirs, w=which: hf[t].chunk(3)[w].clone()
            else:
                name = _GPT2_NAMES[module]
                theirs = _hf_key(hf, h + name + "." + rest)
                if rest == "weight" and module in _CONV1D:
                    out[key] = lambda t=theirs: hf[t].t().contiguous()  # Conv1D (in, out) -> Linear (out, in)
                else:
                    out[key] = StoredTensor(hf, theirs)
    return out


_GPT2_NAMES = {"ln1": "ln_1", "ln2": "ln_2", "attn.out_proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc",
               "mlp.fc2": "mlp.c_proj"}
_CONV1D = ("attn.out_proj", "mlp.fc1", "mlp.fc2")


def _model_keys(num_layers: int) -> list[str]:
    keys = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"]
    for i in range(num_layers):
        for m in ("ln1", "ln2", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            keys += [f"blocks.{i}.{m}.weight", f"blocks.{i}.{m}.bias"]
    return keys


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """transformers GPT-2 tensors (with or without the ``transformer.`` prefix) -> GPTModel tensors."""
    return {k: read() for k, read in tensor_sources(hf_sd, _model_keys(num_layers)).items()}


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
        state_dict_from_hf=lambda hf, model: tensor_sources(hf, model.state_dict().keys()),
        state_dict_to_hf=lambda sd, model: state_dict_to_hf(sd, model.num_layers),
        default_architecture="GPT2LMHeadModel",
        dufu_classes=(GPTModel,),
        lazy=True,
    ))


_register()
