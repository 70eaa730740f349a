"""Rotary position embeddings (Su et al. 2021, "RoFormer"), in the rotate-half layout LLaMA uses."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; ``rope_scaling`` supports Llama 3's frequency scaling."""

    def __init__(self, head_dim: int, max_position_embeddings: int = 2048, base: float = 10000.0,
                 rope_scaling: Optional[dict] = None):
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        inv = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))
        s = self.rope_scaling
        if s and s.get("rope_type", s.get("type")) == "llama3":
            # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
            factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
            old_ctx = s.get("original_max_position_embeddings", 8192)
            wavelen = 2 * torch.pi / inv
            smooth = (old_ctx / wavelen - low) / (high - low)
            scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
            mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
            inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        elif s and s.get("rope_type", s.get("type")) == "linear":
            inv = inv / s["factor"]
        return inv

    def reset_parameters(self) -> None:
        """Recompute the table (after a meta-device build, buffers hold no values)."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, T) or (T,) -> cos, sin of shape (B|1, 1, T, head_dim)."""
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, hd)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hs) rotated by the angles of its positions."""
    return x * cos + rotate_half(x) * sin
