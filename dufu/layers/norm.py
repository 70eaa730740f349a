"""Normalization layers.

Under sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models") the norms run on a sequence shard;
``parallelize`` applies torch's ``SequenceParallel`` style to every module that
declares ``sequence_parallel = True``.
"""

from __future__ import annotations

from torch import nn


class LayerNorm(nn.LayerNorm):
    sequence_parallel = True

    def __init__(self, normalized_shape: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, bias=bias, device=device, dtype=dtype)


class RMSNorm(nn.RMSNorm):
    """Root-mean-square norm (Zhang & Sennrich 2019), as used by LLaMA."""

    sequence_parallel = True

    def __init__(self, normalized_shape: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, device=device, dtype=dtype)
