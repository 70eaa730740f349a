"""Building blocks that know their parallel style. Plain nn.Modules on one device."""

from dufu.layers.attention import Attention, CausalSelfAttention, KVCache, padding_mask_to_bias
from dufu.layers.embedding import HeadwiseEmbedding, PositionEmbedding, TokenTypeEmbedding, VocabEmbedding
from dufu.layers.linear import PARALLEL_STYLES, Linear
from dufu.layers.mla import MLA
from dufu.layers.mlp import MLP, GatedMLP
from dufu.layers.moe import GroupedExperts, MoE
from dufu.layers.norm import LayerNorm, RMSNorm
from dufu.layers.rotary import RotaryEmbedding, apply_rotary
from dufu.layers.transformer_layer import TransformerLayer

__all__ = [
    "Attention",
    "GatedMLP",
    "MoE",
    "GroupedExperts",
    "HeadwiseEmbedding",
    "KVCache",
    "RotaryEmbedding",
    "apply_rotary",
    "padding_mask_to_bias",
    "CausalSelfAttention",
    "LayerNorm",
    "Linear",
    "MLA",
    "MLP",
    "PARALLEL_STYLES",
    "PositionEmbedding",
    "RMSNorm",
    "TokenTypeEmbedding",
    "TransformerLayer",
    "VocabEmbedding",
]
