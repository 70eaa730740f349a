"""Map dufu's GPTModel to and from Hugging Face transformers' GPT-2 (``GPT2LMHeadModel``).

transformers' GPT-2 stores its projections as ``Conv1D`` with weights laid out
(in_features, out_features) — the transpose of ``nn.Linear`` — and fuses Q, K, V
into one ``c_attn`` matrix. dufu keeps separate q/k/v projections (so tensor
parallelism splits whole heads), hence the ``Fused`` and ``Transposed`` rules of the table below.
"""

from __future__ import annotations

from dufu.models.gpt.model import GPTModel
from dufu.models.hf_adapter import Fused, HFMapping, Transposed
from dufu.models.hub import register

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


MAPPING = register(HFMapping(
    model_type="gpt2",
    classes={"GPT2LMHeadModel": GPTModel},
    names=[
        ("wte", "transformer.wte"),
        ("wpe", "transformer.wpe"),
        ("ln_f", "transformer.ln_f"),
        ("lm_head.weight", ("lm_head.weight", "transformer.wte.weight")),  # a tied head: the embedding
        ("blocks.{i}.ln1", "transformer.h.{i}.ln_1"),
        ("blocks.{i}.ln2", "transformer.h.{i}.ln_2"),
        ("blocks.{i}.attn.out_proj", "transformer.h.{i}.attn.c_proj"),
        ("blocks.{i}.mlp.fc1", "transformer.h.{i}.mlp.c_fc"),
        ("blocks.{i}.mlp.fc2", "transformer.h.{i}.mlp.c_proj"),
    ],
    transforms=[
        # Conv1D keeps (in, out); c_attn holds q | k | v along its output dim
        Transposed("blocks.{i}.attn.out_proj", "blocks.{i}.mlp.fc1", "blocks.{i}.mlp.fc2"),
        Fused(("blocks.{i}.attn.q_proj", "blocks.{i}.attn.k_proj", "blocks.{i}.attn.v_proj"),
              "transformer.h.{i}.attn.c_attn", dim=0, transposed=True),
    ],
    load_renames=[(r"^(?!transformer\.|lm_head\.)", "transformer.")],  # saved without the prefix too
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    default_architecture="GPT2LMHeadModel",
    dufu_classes=(GPTModel,),
))
