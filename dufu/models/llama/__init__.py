"""LLaMA (and Qwen2): the decoder with RMSNorm, rotary positions, SwiGLU and grouped-query attention."""

from dufu.models.llama.model import LlamaBlock, LlamaModel

__all__ = ["LlamaBlock", "LlamaModel"]
