"""Map dufu's Swin to and from Hugging Face transformers' ``SwinForImageClassification``.

transformers groups blocks by stage (``swin.encoder.layers.{s}.blocks.{j}``, patch merging as
``layers.{s}.downsample``); dufu numbers blocks across stages (``blocks.{k}``) and keeps a stage's patch
merging in its last block. Names are written as transformers stores them in checkpoints
(``attention.self.query`` ...); transformers 5's in-memory names (``attention.q_proj`` ...) are accepted.
The relative-position index buffer of older checkpoints is recomputed, not read.
"""

from __future__ import annotations

from dufu.models.hf_adapter import HFMapping
from dufu.models.hub import register
from dufu.models.swin.model import SwinForImageClassification
from dufu.models.vit.hf import ACT_TO_HF, activation_from_hf, labels_to_hf, num_labels_from_hf

_BLOCK = {
    "ln1": "layernorm_before",
    "ln2": "layernorm_after",
    "attn.q_proj": "attention.self.query",
    "attn.k_proj": "attention.self.key",
    "attn.v_proj": "attention.self.value",
    "attn.out_proj": "attention.output.dense",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}
_NEW_TO_SAVED = [
    (r"\.attention\.q_proj\.", ".attention.self.query."),
    (r"\.attention\.k_proj\.", ".attention.self.key."),
    (r"\.attention\.v_proj\.", ".attention.self.value."),
    (r"\.attention\.o_proj\.", ".attention.output.dense."),
    (r"\.attention\.relative_position_bias\.relative_position_bias_table$",
     ".attention.self.relative_position_bias_table"),
    (r"\.mlp\.fc1\.", ".intermediate.dense."),
    (r"\.mlp\.fc2\.", ".output.dense."),
]


def config_from_hf(hf: dict) -> dict:
    return dict(
        image_size=hf.get("image_size", 224),
        patch_size=hf.get("patch_size", 4),
        num_channels=hf.get("num_channels", 3),
        num_labels=num_labels_from_hf(hf),
        embed_dim=hf.get("embed_dim", 96),
        depths=list(hf.get("depths", [2, 2, 6, 2])),
        num_heads=list(hf.get("num_heads", [3, 6, 12, 24])),
        window_size=hf.get("window_size", 7),
        mlp_ratio=hf.get("mlp_ratio", 4.0),
        qkv_bias=hf.get("qkv_bias", True),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.0),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.0),
        drop_path_rate=hf.get("drop_path_rate", 0.1),
        activation=activation_from_hf(hf.get("hidden_act", "gelu")),
        use_absolute_embeddings=hf.get("use_absolute_embeddings", False),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
        initializer_range=hf.get("initializer_range", 0.02),
    )


def config_to_hf(model) -> dict:
    block = model.blocks["0"]
    return {
        "architectures": ["SwinForImageClassification"],
        "model_type": "swin",
        "image_size": model.image_size[0] if model.image_size[0] == model.image_size[1] else list(model.image_size),
        "patch_size": model.patch_size[0] if model.patch_size[0] == model.patch_size[1] else list(model.patch_size),
        "num_channels": model.num_channels,
        "embed_dim": model.embed_dim,
        "depths": list(model.depths),
        "num_heads": list(model.num_heads),
        "window_size": model.window_size,
        "mlp_ratio": model.mlp_ratio,
        "qkv_bias": block.attn.q_proj.bias is not None,
        "hidden_dropout_prob": model.embeddings.drop.p,
        "attention_probs_dropout_prob": block.attn.attention_dropout,
        "drop_path_rate": model.drop_path_rate,
        "hidden_act": ACT_TO_HF[block.mlp.activation],
        "use_absolute_embeddings": model.embeddings.position_embeddings is not None,
        "layer_norm_eps": model.layer_norm_eps,
        "initializer_range": model.initializer_range,
        "torch_dtype": "float32",
        **labels_to_hf(model.num_labels),
    }


def _stage_and_block(model, values: dict) -> dict:
    """dufu's block k is block j of stage s in transformers."""
    stage_of = model.stage_of_block()
    k = int(values["i"])
    return {"s": stage_of[k], "j": k - stage_of.index(stage_of[k])}


_STAGE_BLOCK = "swin.encoder.layers.{s}.blocks.{j}"
MAPPING = register(HFMapping(
    model_type="swin",
    classes={"SwinForImageClassification": SwinForImageClassification},
    names=[
        ("blocks.{i}.downsample", "swin.encoder.layers.{s}.downsample"),  # a stage's last block holds it
        ("blocks.{i}.attn.relative_position_bias.weight",
         _STAGE_BLOCK + ".attention.self.relative_position_bias_table"),
        *((f"blocks.{{i}}.{ours}", f"{_STAGE_BLOCK}.{theirs}") for ours, theirs in _BLOCK.items()),
        ("embeddings.patch_embed.proj", "swin.embeddings.patch_embeddings.projection"),
        ("embeddings.norm", "swin.embeddings.norm"),
        ("embeddings.position_embeddings", "swin.embeddings.position_embeddings"),
        ("norm", "swin.layernorm"),
        ("classifier", "classifier"),
    ],
    placeholders=_stage_and_block,
    load_renames=_NEW_TO_SAVED,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    default_architecture="SwinForImageClassification",
    dufu_classes=(SwinForImageClassification,),
))
