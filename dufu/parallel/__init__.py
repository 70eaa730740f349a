from dufu.parallel.parallelize import apply_activation_checkpointing, apply_compile, parallelize
from dufu.parallel.parallelize_utils import transformer_blocks

__all__ = ["apply_activation_checkpointing", "apply_compile", "parallelize", "transformer_blocks"]
