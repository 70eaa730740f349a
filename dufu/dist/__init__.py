"""Distributed state (ParallelDims, DeviceMesh) and LiBai-style global-view helpers."""

from dufu.dist.parallel_dims import ParallelDims

__all__ = ["ParallelDims"]
