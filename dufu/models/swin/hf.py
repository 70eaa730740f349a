"""Map dufu's Swin to and from Hugging Face transformers' ``SwinForImageClassification``.

transformers groups blocks by stage (``swin.encoder.layers.{s}.blocks.{j}``, patch merging as
``layers.{s}.downsample``); dufu numbers blocks across stages (``blocks.{k}``) and keeps a stage's patch
merging in its last block. Names are written as transformers stores them in checkpoints
(``attention.self.query`` ...); transformers 5's in-memory names (``attention.q_proj`` ...) are accepted.
The relative-position index buffer of older checkpoints is recomputed, not read.
"""

from __future__ import annotations

from dufu.models.hf_adapter import ConfigField, HFConfigMap, HFMapping, square_or_pair
from dufu.models.hub import register
from dufu.models.swin.model import SwinForImageClassification
from dufu.models.vit.hf import LABEL_FIELDS, activation_field

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


CONFIG = HFConfigMap(
    fields=[
        ConfigField("image_size", "image_size", default=224, to_hf=square_or_pair),
        ConfigField("patch_size", "patch_size", default=4, to_hf=square_or_pair),
        ConfigField("num_channels", "num_channels", default=3),
        ConfigField("embed_dim", "embed_dim", default=96),
        ConfigField("depths", "depths", default=[2, 2, 6, 2], from_hf=list, to_hf=list),
        ConfigField("num_heads", "num_heads", default=[3, 6, 12, 24], from_hf=list, to_hf=list),
        ConfigField("window_size", "window_size", default=7),
        ConfigField("mlp_ratio", "mlp_ratio", default=4.0),
        ConfigField("qkv_bias", "qkv_bias", default=True, export=lambda m: m.blocks["0"].attn.q_proj.bias is not None),
        ConfigField("hidden_dropout", "hidden_dropout_prob", default=0.0, export="embeddings.drop.p"),
        ConfigField("attention_dropout", "attention_probs_dropout_prob", default=0.0,
                    export="blocks.0.attn.attention_dropout"),
        ConfigField("drop_path_rate", "drop_path_rate", default=0.1),
        activation_field("blocks.0.mlp.activation"),
        ConfigField("use_absolute_embeddings", "use_absolute_embeddings", default=False,
                    export=lambda m: m.embeddings.position_embeddings is not None),
        ConfigField("layer_norm_eps", "layer_norm_eps", default=1e-5),
        ConfigField("initializer_range", "initializer_range", default=0.02),
        *LABEL_FIELDS,
    ],
    constants={"torch_dtype": "float32"},
)


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
    config=CONFIG,
    default_architecture="SwinForImageClassification",
    dufu_classes=(SwinForImageClassification,),
))
