"""Building blocks that know their parallel style. Plain nn.Modules on one device."""

from dufu.layers.attention import CausalSelfAttention
from dufu.layers.embedding import PositionEmbedding, VocabEmbedding
from dufu.layers.linear import PARALLEL_STYLES, Linear
from dufu.layers.mlp import MLP
from dufu.layers.norm import LayerNorm, RMSNorm
from dufu.layers.transformer_layer import TransformerLayer

__all__ = [
    "CausalSelfAttention",
    "LayerNorm",
    "Linear",
    "MLP",
    "PARALLEL_STYLES",
    "PositionEmbedding",
    "RMSNorm",
    "TransformerLayer",
    "VocabEmbedding",
]
