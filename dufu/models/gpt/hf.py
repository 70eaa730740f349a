"""Map dufu's GPTModel to and from Hugging Face transformers' GPT-2 (``GPT2LMHeadModel``).

transformers' GPT-2 stores its projections as ``Conv1D`` with weights laid out
(in_features, out_features) — the transpose of ``nn.Linear`` — and fuses Q, K, V
into one ``c_attn`` matrix. dufu keeps separate q/k/v projections (so tensor
parallelism splits whole heads), hence the ``Fused`` and ``Transposed`` rules of the table below.
"""

from __future__ import annotations

from dufu.models.gpt.model import GPTModel
from dufu.models.hf_adapter import ConfigField, Fused, HFConfigMap, HFMapping, Transposed, in_first_block
from dufu.models.hub import register

# dufu activation <-> transformers' ACT2FN name (GPT-2 writes the tanh approximation as "gelu_new")
ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
               "silu": "silu", "swish": "silu"}


CONFIG = HFConfigMap(
    fields=[
        ConfigField("vocab_size", "vocab_size"),
        ConfigField("hidden_size", "n_embd"),
        ConfigField("num_layers", "n_layer"),
        ConfigField("num_attention_heads", "n_head"),
        ConfigField("ffn_hidden_size", "n_inner", default=lambda hf: 4 * hf["n_embd"], or_default=True,
                    export=in_first_block("mlp.fc1.out_features", lambda m: 4 * m.hidden_size)),
        ConfigField("max_position_embeddings", "n_positions"),
        ConfigField("max_position_embeddings", "n_ctx", load=False),  # GPT-2's older key for the same length
        ConfigField("embedding_dropout", "embd_pdrop", default=0.0, export="drop.p"),
        # written as 0.0, not taken from the model
        ConfigField("hidden_dropout", "resid_pdrop", default=0.0, export=lambda m: 0.0),
        ConfigField("attention_dropout", "attn_pdrop", default=0.0, export=lambda m: 0.0),
        ConfigField("layernorm_epsilon", "layer_norm_epsilon", default=1e-5, export="ln_f.eps"),
        ConfigField("activation", "activation_function", default="gelu_tanh", from_hf=ACT_FROM_HF, to_hf=ACT_TO_HF,
                    export=in_first_block("mlp.activation", "gelu_tanh")),
        ConfigField("tie_word_embeddings", "tie_word_embeddings", default=True),
        ConfigField("initializer_range", "initializer_range", default=0.02),
    ],
    constants={"torch_dtype": "float32"},
)


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
    config=CONFIG,
    default_architecture="GPT2LMHeadModel",
    dufu_classes=(GPTModel,),
))
