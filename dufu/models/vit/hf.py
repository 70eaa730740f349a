"""Map dufu's ViT to and from Hugging Face transformers' ``ViTForImageClassification``.

Names are written as transformers stores them in checkpoints (``vit.encoder.layer.{i}.attention.attention.query``
...); the names transformers 5 uses in memory (``vit.layers.{i}.attention.q_proj`` ...) are accepted on load.
"""

from __future__ import annotations

from dufu.models.hf_adapter import HFMapping
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


def num_labels_from_hf(hf: dict) -> int:
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def activation_from_hf(act: str) -> str:
    if act not in ACT_FROM_HF:
        raise ValueError(f"hidden_act {act!r} is not supported; known: {sorted(ACT_FROM_HF)}")
    return ACT_FROM_HF[act]


def config_from_hf(hf: dict) -> dict:
    return dict(
        image_size=hf.get("image_size", 224),
        patch_size=hf.get("patch_size", 16),
        num_channels=hf.get("num_channels", 3),
        num_labels=num_labels_from_hf(hf),
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        hidden_dropout=hf.get("hidden_dropout_prob", 0.0),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.0),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        qkv_bias=hf.get("qkv_bias", True),
        activation=activation_from_hf(hf.get("hidden_act", "gelu")),
        initializer_range=hf.get("initializer_range", 0.02),
    )


def labels_to_hf(num_labels: int) -> dict:
    return {"id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
            "label2id": {f"LABEL_{i}": i for i in range(num_labels)}}


def config_to_hf(model) -> dict:
    block = model.blocks["0"] if len(model.blocks) else None
    return {
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "image_size": model.image_size[0] if model.image_size[0] == model.image_size[1] else list(model.image_size),
        "patch_size": model.patch_size[0] if model.patch_size[0] == model.patch_size[1] else list(model.patch_size),
        "num_channels": model.num_channels,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "intermediate_size": model.ffn_hidden_size,
        "hidden_act": ACT_TO_HF[block.mlp.activation if block is not None else "gelu"],
        "hidden_dropout_prob": model.embeddings.drop.p,
        "attention_probs_dropout_prob": block.attn.attention_dropout if block is not None else 0.0,
        "layer_norm_eps": model.layer_norm_eps,
        "qkv_bias": block.attn.q_proj.bias is not None if block is not None else True,
        "initializer_range": model.initializer_range,
        "torch_dtype": "float32",
        **labels_to_hf(model.num_labels),
    }


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
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    default_architecture="ViTForImageClassification",
    dufu_classes=(ViTForImageClassification,),
))
