"""Embeddings.

``VocabEmbedding`` is the token embedding whose table is split along the
vocabulary under tensor parallelism (Megatron's VocabParallelEmbedding): each
rank looks up the ids it owns and the partial results are summed. The module
is a plain ``nn.Embedding``; ``parallelize`` applies the plan.

``HeadwiseEmbedding`` is a table with one column per attention head (the
relative position biases of T5 and Swin); tensor parallelism splits it by
columns, so each rank looks up the biases of the heads it owns.
"""

from __future__ import annotations

from torch import nn


class VocabEmbedding(nn.Embedding):
    parallel = "vocab"

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)


class PositionEmbedding(nn.Embedding):
    """Learned absolute positions (GPT-2, BERT). Replicated under tensor parallelism."""

    parallel = "data"

    def __init__(self, max_positions: int, embedding_dim: int, device=None, dtype=None):
        super().__init__(max_positions, embedding_dim, device=device, dtype=dtype)


class HeadwiseEmbedding(nn.Embedding):
    """A (num_entries, num_heads) table of per-head values, e.g. a relative position bias.

    Under tensor parallelism it is split by columns (``parallel = "col"``), like the column-parallel
    Q/K/V projections, so a lookup returns the values of this rank's heads only: (..., num_heads / tp)."""

    parallel = "col"

    def __init__(self, num_embeddings: int, num_heads: int, device=None, dtype=None):
        super().__init__(num_embeddings, num_heads, device=device, dtype=dtype)


class TokenTypeEmbedding(PositionEmbedding):
    """Segment (token type) embeddings (BERT's sentence A / B). A small table, replicated under tensor
    parallelism; like positions, its output is sliced along the sequence under sequence parallelism."""

    def __init__(self, num_types: int, embedding_dim: int, device=None, dtype=None):
        super().__init__(num_types, embedding_dim, device=device, dtype=dtype)
