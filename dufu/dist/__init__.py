"""Distributed state (ParallelDims, DeviceMesh) and LiBai-style global-view helpers.

``setup()`` returns a :class:`DistContext`; ``get_layer_placement``, ``get_nd_sbp``,
``to_global`` and ``to_local`` speak LiBai's placement/SBP vocabulary on DTensor
(see ``dufu/dist/global_view.py`` and ``docs/parallelism.md``).
"""

from dufu.dist.global_view import (
    DistContext,
    broadcast,
    get_layer_placement,
    get_nd_sbp,
    partial_sum,
    setup,
    split,
    to_global,
    to_local,
)
from dufu.dist.parallel_dims import ParallelDims

__all__ = [
    "DistContext",
    "ParallelDims",
    "broadcast",
    "get_layer_placement",
    "get_nd_sbp",
    "partial_sum",
    "setup",
    "split",
    "to_global",
    "to_local",
]
