"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words") for image
classification, single-device code built from dufu.layers.

The image is cut into ``patch_size`` x ``patch_size`` patches, each linearly embedded (a strided
convolution), a learned [CLS] token is prepended and learned absolute positions are added. Pre-LN blocks
(GELU MLP) follow; the final norm's [CLS] output feeds a linear classifier.

Blocks live in a ``ModuleDict`` keyed ``str(i)``. For pipeline parallelism the first stage keeps
``embeddings`` and the last keeps ``norm`` and ``classifier``; stages pass the (B, 1 + N, C) hidden states.
The classifier is small and stays replicated under tensor parallelism (logits are plain (B, classes)).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dufu.layers import MLP, Attention, LayerNorm, Linear
from dufu.layers import init
from dufu.layers.loss import classification_loss
from dufu.models.base import InitByModule
from dufu.models.outputs import ModelOutput


def pair(x) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


class PatchEmbedding(nn.Module):
    """(B, C_in, H, W) -> (B, N, C) with N = (H / p) * (W / p): one strided convolution."""

    def __init__(self, image_size, patch_size, num_channels: int, hidden_size: int):
        super().__init__()
        self.image_size, self.patch_size = pair(image_size), pair(patch_size)
        self.grid_size = (self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(num_channels, hidden_size, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values).flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, C)


class ViTEmbeddings(nn.Module):
    def __init__(self, image_size, patch_size, num_channels: int, hidden_size: int, dropout: float = 0.0):
        super().__init__()
        self.patch_embed = PatchEmbedding(image_size, patch_size, num_channels, hidden_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden_size))
        self.position_embeddings = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, hidden_size))
        self.drop = nn.Dropout(dropout)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        expected = self.patch_embed.image_size
        if tuple(pixel_values.shape[-2:]) != expected:
            raise ValueError(f"ViT: images are {tuple(pixel_values.shape[-2:])}, but the model was built for "
                             f"image_size {expected}")
        x = self.patch_embed(pixel_values)  # (B, N, C)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, C)
        return self.drop(torch.cat([cls, x], dim=1) + self.position_embeddings)  # (B, 1 + N, C)


class ViTBlock(nn.Module):
    """Pre-LN encoder block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))`` (bidirectional attention)."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, layer_idx: int,
                 dropout: float = 0.0, attention_dropout: float = 0.0, layer_norm_eps: float = 1e-12,
                 qkv_bias: bool = True, activation: str = "gelu"):
        super().__init__()
        self.layer_idx = layer_idx
        self.ln1 = LayerNorm(hidden_size, eps=layer_norm_eps)
        self.attn = Attention(hidden_size, num_heads, qkv_bias=qkv_bias, out_bias=True, causal=False,
                              attention_dropout=attention_dropout, dropout=dropout)
        self.ln2 = LayerNorm(hidden_size, eps=layer_norm_eps)
        self.mlp = MLP(hidden_size, ffn_hidden_size, activation=activation, bias=True, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ViTForImageClassification(InitByModule, nn.Module):
    """ViT image classifier (transformers' ``ViTForImageClassification``).

    ``forward(pixel_values, labels=None)``: pixel_values (B, C, H, W) float, labels (B,) int64 ->
    ``ModelOutput(loss, logits (B, num_labels))``."""

    pipeline_layout = {"blocks": "blocks", "first": ("embeddings",), "last": ("norm", "classifier")}
    main_input_name = "pixel_values"
    sequence_parallel_unsupported_reason = "ViT's 1 + N positions ([CLS] + patches) are not split across ranks"
    context_parallel_unsupported_reason = (
        "an image is a few hundred patches, far from the lengths that need splitting, and the label is read from "
        "[CLS], which one rank would hold")

    def __init__(
        self,
        image_size=224,
        patch_size=16,
        num_channels: int = 3,
        num_labels: int = 1000,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_attention_heads: int = 12,
        ffn_hidden_size: Optional[int] = None,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        layer_norm_eps: float = 1e-12,
        qkv_bias: bool = True,
        activation: str = "gelu",
        initializer_range: float = 0.02,
    ):
        super().__init__()
        if hidden_size % num_attention_heads != 0:
            raise ValueError(f"ViT: hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}")
        self.image_size, self.patch_size = pair(image_size), pair(patch_size)
        if self.image_size[0] % self.patch_size[0] or self.image_size[1] % self.patch_size[1]:
            raise ValueError(f"ViT: image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        self.num_channels = num_channels
        self.num_labels = num_labels
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.return_dict = True

        self.embeddings = ViTEmbeddings(image_size, patch_size, num_channels, hidden_size, hidden_dropout)
        self.blocks = nn.ModuleDict({
            str(i): ViTBlock(hidden_size, num_attention_heads, self.ffn_hidden_size, layer_idx=i,
                             dropout=hidden_dropout, attention_dropout=attention_dropout,
                             layer_norm_eps=layer_norm_eps, qkv_bias=qkv_bias, activation=activation)
            for i in range(num_layers)
        })
        self.norm = LayerNorm(hidden_size, eps=layer_norm_eps)
        self.classifier = Linear(hidden_size, num_labels, bias=True)  # replicated: a small head
        self.finish_init()

    def init_module(self, name: str, module: nn.Module) -> None:
        """Truncated N(0, 0.02) for projections, the [CLS] token and positions; zero biases; unit norms."""
        std = self.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, ViTEmbeddings):
            init.trunc_normal_(module.cls_token, std=std, a=-2 * std, b=2 * std)
            init.trunc_normal_(module.position_embeddings, std=std, a=-2 * std, b=2 * std)

    def forward(self, pixel_values: torch.Tensor, labels: Optional[torch.Tensor] = None):
        """On an inner pipeline stage ``pixel_values`` are the hidden states (B, 1 + N, C)."""
        h = self.embeddings(pixel_values) if self.embeddings is not None else pixel_values
        for block in self.blocks.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.classifier is None:
            return h if not self.return_dict else ModelOutput(last_hidden_state=h)
        logits = self.classifier(h[:, 0])  # the [CLS] position: (B, num_labels)
        if not self.return_dict and labels is None:
            return logits
        loss = classification_loss(logits, labels) if labels is not None else None
        return ModelOutput(loss=loss, logits=logits)


ViTForImageClassification.pipeline_loss = staticmethod(classification_loss)


def count_vit_parameters(image_size: int, patch_size: int, num_channels: int, num_labels: int, hidden_size: int,
                         num_layers: int, ffn_hidden_size: Optional[int] = None) -> int:
    """The parameter count from the sizes (ViT-B/16 at 224 with 1000 classes: 86,567,656)."""
    H, F_ = hidden_size, ffn_hidden_size or 4 * hidden_size
    n = (image_size // patch_size) ** 2
    embed = num_channels * patch_size * patch_size * H + H + H + (n + 1) * H  # conv, conv bias, cls, positions
    block = 4 * (H * H + H) + (H * F_ + F_) + (F_ * H + H) + 4 * H  # q k v o, fc1, fc2, two LayerNorms
    return embed + num_layers * block + 2 * H + H * num_labels + num_labels
