"""Map dufu's ViT to and from Hugging Face transformers' ``ViTForImageClassification``.

Names are written as transformers stores them in checkpoints (``vit.encoder.layer.{i}.attention.attention.query``
...); the names transformers 5 uses in memory (``vit.layers.{i}.attention.q_proj`` ...) are accepted on load.
"""

from __future__ import annotations

from dufu.models.hf_adapter import (
    ConfigField,
    HFConfigMap,
    HFMapping,
    id2label,
    in_first_block,
    label2id,
    square_or_pair,
)
from dufu.models.hub import register
from dufu.models.vit.model import ViTForImageClassification

ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}
ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}

# checkpoint name inside an encoder layer <- dufu name inside a block
_BLOCK = {
    "ln1": "layernorm_before",
    "ln2": "layernorm_after",
    "attn.q_proj": "attention.attention.query",
    "attn.k_proj": "attention.attention.key",
    "attn.v_proj": "attention.attention.value",
    "attn.out_proj": "attention.output.dense",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}
# transformers 5 in-memory names -> checkpoint names
_NEW_TO_SAVED = [
    (r"^vit\.layers\.(\d+)\.", r"vit.encoder.layer.\1."),
    (r"\.attention\.q_proj\.", ".attention.attention.query."),
    (r"\.attention\.k_proj\.", ".attention.attention.key."),
    (r"\.attention\.v_proj\.", ".attention.attention.value."),
    (r"\.attention\.o_proj\.", ".attention.output.dense."),
    (r"\.mlp\.fc1\.", ".intermediate.dense."),
    (r"\.mlp\.fc2\.", ".output.dense."),
]


# The label rows ViT and Swin share: id2label (its length) wins over num_labels on load; both are written.
LABEL_FIELDS = [
    ConfigField("num_labels", "id2label", from_hf=len, or_default=True, to_hf=id2label,
                default=lambda hf: int(hf.get("num_labels", 2))),
    ConfigField("num_labels", "label2id", to_hf=label2id, load=False),
]


def activation_field(export) -> ConfigField:
    return ConfigField("activation", "hidden_act", default="gelu", from_hf=ACT_FROM_HF, to_hf=ACT_TO_HF, export=export)


CONFIG = HFConfigMap(
    fields=[
        ConfigField("image_size", "image_size", default=224, to_hf=square_or_pair),
        ConfigField("patch_size", "patch_size", default=16, to_hf=square_or_pair),
        ConfigField("num_channels", "num_channels", default=3),
        ConfigField("hidden_size", "hidden_size"),
        ConfigField("num_layers", "num_hidden_layers"),
        ConfigField("num_attention_heads", "num_attention_heads"),
        ConfigField("ffn_hidden_size", "intermediate_size"),
        activation_field(in_first_block("mlp.activation", "gelu")),
        ConfigField("hidden_dropout", "hidden_dropout_prob", default=0.0, export="embeddings.drop.p"),
        ConfigField("attention_dropout", "attention_probs_dropout_prob", default=0.0,
                    export=in_first_block("attn.attention_dropout", 0.0)),
        ConfigField("layer_norm_eps", "layer_norm_eps", default=1e-12),
        ConfigField("qkv_bias", "qkv_bias", default=True,
                    export=lambda m: in_first_block("attn.q_proj.bias", 0)(m) is not None),
        ConfigField("initializer_range", "initializer_range", default=0.02),
        *LABEL_FIELDS,
    ],
    constants={"torch_dtype": "float32"},
)


MAPPING = register(HFMapping(
    model_type="vit",
    classes={"ViTForImageClassification": ViTForImageClassification},
    names=[
        *((f"blocks.{{i}}.{ours}", f"vit.encoder.layer.{{i}}.{theirs}") for ours, theirs in _BLOCK.items()),
        ("embeddings.cls_token", "vit.embeddings.cls_token"),
        ("embeddings.position_embeddings", "vit.embeddings.position_embeddings"),
        ("embeddings.patch_embed.proj", "vit.embeddings.patch_embeddings.projection"),
        ("norm", "vit.layernorm"),
        ("classifier", "classifier"),
    ],
    load_renames=_NEW_TO_SAVED,
    config=CONFIG,
    default_architecture="ViTForImageClassification",
    dufu_classes=(ViTForImageClassification,),
))
