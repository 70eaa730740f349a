"""Parallelism applied in one place: the run's layout (ParallelDims, the mesh) and parallelize() with its steps."""

from dufu.parallel.parallel_dims import ParallelDims
from dufu.parallel.parallelize import apply_activation_checkpointing, apply_compile, parallelize
from dufu.parallel.parallelize_utils import transformer_blocks

__all__ = ["ParallelDims", "apply_activation_checkpointing", "apply_compile", "parallelize", "transformer_blocks"]
