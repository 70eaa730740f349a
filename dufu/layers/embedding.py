"""Embeddings.

``VocabEmbedding`` is the token embedding whose table is split along the
vocabulary under tensor parallelism (Megatron's VocabParallelEmbedding): each
rank looks up the ids it owns and the partial results are summed. The module
is a plain ``nn.Embedding``; ``parallelize`` applies the plan.
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
