"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE): LLaMA blocks whose MLP is routed to experts."""

from dufu.models.moe.model import MoEModel

__all__ = ["MoEModel"]
