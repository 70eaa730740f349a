"""T5's relative position bias (Raffel et al. 2020, section 2.1): no absolute positions; a learned scalar per
(relative-distance bucket, head) is added to the attention logits. The table is a
:class:`~dufu.layers.HeadwiseEmbedding` (``parallel="col"``), so tensor parallelism gives every rank the bias
columns of its own heads."""

from __future__ import annotations

import math

import torch
from torch import nn

from dufu.layers import HeadwiseEmbedding


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket of each relative position ``key - query`` (T5 section 2.1).

    Half of the buckets hold small distances exactly; the other half cover distances up to
    ``max_distance`` on a log scale (farther ones share the last bucket). Bidirectional (encoder):
    the buckets are halved between keys before and after the query. Unidirectional (decoder):
    only keys at or before the query get distinct buckets."""
    n = num_buckets
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        n //= 2
        bucket = bucket + (relative_position > 0).long() * n
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = n // 2
    # log-spaced buckets exact .. n-1 for distances exact .. max_distance
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (n - exact)).long()).clamp(max=n - 1)
    return bucket + torch.where(distance < exact, distance, far)


class T5RelativeBias(nn.Module):
    """The additive attention bias of one stack: a (num_buckets, num_heads) table indexed by bucket."""

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.table = HeadwiseEmbedding(num_buckets, num_heads)

    def forward(self, query_length: int, key_length: int, offset: int = 0) -> torch.Tensor:
        """-> (1, num_heads_local, query_length, key_length). ``offset``: position of the first query."""
        device = self.table.weight.device
        q = torch.arange(query_length, device=device)[:, None] + offset
        k = torch.arange(key_length, device=device)[None, :]
        buckets = relative_position_bucket(k - q, self.bidirectional, self.num_buckets, self.max_distance)
        bias = self.table(buckets)  # (Tq, Tk, nh_local): under TP, this rank's heads
        return bias.permute(2, 0, 1).unsqueeze(0)
