"""Swin Transformer (Liu et al. 2021, "Swin Transformer: Hierarchical Vision Transformer using Shifted
Windows") for image classification, single-device code built from dufu.layers.

* Patches of ``patch_size`` are embedded (a strided convolution + LayerNorm).
* Blocks attend within non-overlapping ``window_size`` x ``window_size`` windows; every second block
  shifts the windows by half a window (a cyclic roll of the feature map, with a mask that keeps
  tokens from attending across the wrapped-around edges), so information crosses window borders.
* Attention adds a learned relative position bias: one value per head for each of the
  (2w - 1)^2 relative offsets inside a window, kept in a :class:`~dufu.layers.HeadwiseEmbedding`
  (``parallel="col"``), so tensor parallelism splits it by head like the Q/K/V projections.
* After each stage but the last, patch merging concatenates 2x2 neighbours (4C) and projects to 2C,
  halving the resolution.
* The final LayerNorm's tokens are averaged and classified.

All blocks of all stages live in one ``ModuleDict`` keyed ``str(i)`` (numbered across stages); a stage's
patch merging belongs to its last block. Each block knows the resolution it works at, so pipeline stages
pass one tensor, (B, H*W, C) at that block's resolution, and can split anywhere.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from dufu.layers import MLP, Attention, HeadwiseEmbedding, LayerNorm, Linear, init
from dufu.models.base import InitByModule
from dufu.models.outputs import ModelOutput
from dufu.models.vit.model import PatchEmbedding, classification_loss, pair


def relative_position_index(window: int, table_window: Optional[int] = None, device=None) -> torch.Tensor:
    """(w*w, w*w) index into a (2W-1)^2 table (W = ``table_window``, default w): the offset (dy, dx) between
    two tokens of a window, each shifted into [0, 2W-2], as the row-major number dy * (2W - 1) + dx.
    A window smaller than the table's (a feature map smaller than ``window_size``) uses its centre."""
    W = table_window or window
    ys, xs = torch.meshgrid(torch.arange(window, device=device), torch.arange(window, device=device), indexing="ij")
    coords = torch.stack([ys.flatten(), xs.flatten()])  # (2, w*w)
    rel = coords[:, :, None] - coords[:, None, :] + (W - 1)  # (2, w*w, w*w), each in [W-w, W+w-2]
    return rel[0] * (2 * W - 1) + rel[1]


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """(B, H, W, C) -> (B * H/w * W/w, w*w, C); windows ordered batch, row, column."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C).transpose(2, 3)  # (B, H/w, W/w, w, w, C)
    return x.reshape(-1, window * window, C)


def window_merge(windows: torch.Tensor, window: int, H: int, W: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: (B * nW, w*w, C) -> (B, H, W, C)."""
    C = windows.shape[-1]
    x = windows.view(-1, H // window, W // window, window, window, C).transpose(2, 3)  # (B, H/w, w, W/w, w, C)
    return x.reshape(-1, H, W, C)


def shifted_window_mask(H: int, W: int, window: int, shift: int, device=None) -> torch.Tensor:
    """(nW, w*w, w*w) additive mask for shifted windows: after the roll, a window at the bottom/right edge
    holds pieces from up to 3 x 3 regions of the original map; tokens only attend within their region.
    The masked value is -100 (as the reference implementation; exp(-100) is 0 in fp32)."""
    h = torch.arange(H, device=device)
    w = torch.arange(W, device=device)
    h_region = (h >= H - window).long() + (h >= H - shift).long()  # 0, 1, 2 along each axis
    w_region = (w >= W - window).long() + (w >= W - shift).long()
    region = (h_region[:, None] * 3 + w_region[None, :]).float()  # (H, W)
    region = window_partition(region[None, :, :, None], window).squeeze(-1)  # (nW, w*w)
    different = region[:, None, :] != region[:, :, None]  # (nW, w*w, w*w)
    return torch.zeros(different.shape, device=device).masked_fill(different, -100.0)


class WindowAttention(Attention):
    """Multi-head self-attention inside each window, plus the relative position bias of the window."""

    def __init__(self, dim: int, num_heads: int, window: int, table_window: Optional[int] = None, qkv_bias: bool = True,
                 attention_dropout: float = 0.0, dropout: float = 0.0):
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, out_bias=True, causal=False,
                         attention_dropout=attention_dropout, dropout=dropout)
        self.window = window
        # The table is sized for the configured window even where the map (and so the window) is smaller,
        # so every block's table has the shape published checkpoints have.
        self.table_window = table_window or window
        self.relative_position_bias = HeadwiseEmbedding((2 * self.table_window - 1) ** 2, num_heads)

    def forward(self, windows: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """windows (B * nW, w*w, C); mask (nW, w*w, w*w) additive or None."""
        index = relative_position_index(self.window, self.table_window, windows.device)
        bias = self.relative_position_bias(index).permute(2, 0, 1).unsqueeze(0)  # (1, nh_local, w*w, w*w)
        if mask is not None:
            nW, N = mask.shape[0], mask.shape[1]
            mask = mask.unsqueeze(0).expand(windows.shape[0] // nW, -1, -1, -1).reshape(-1, 1, N, N)  # (B*nW, 1, N, N)
        return super().forward(windows, attention_mask=mask, position_bias=bias)


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): drop a residual branch for a whole sample while training."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class PatchMerging(nn.Module):
    """(B, H*W, C) -> (B, H/2*W/2, 2C): concatenate each 2x2 neighbourhood, LayerNorm, project."""

    def __init__(self, dim: int, resolution: tuple[int, int]):
        super().__init__()
        self.resolution = resolution
        self.norm = LayerNorm(4 * dim)
        self.reduction = Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H, W = self.resolution
        B, _, C = x.shape
        x = x.view(B, H, W, C)
        if H % 2 or W % 2:
            x = nn.functional.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        # order (row, col) offsets (0,0), (1,0), (0,1), (1,1), as the published weights expect
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))


class SwinBlock(nn.Module):
    """(shifted) window attention and MLP, pre-LN, each a residual branch; then patch merging if it ends
    a stage (not the last)."""

    def __init__(self, dim: int, resolution: tuple[int, int], num_heads: int, window_size: int, shift: bool,
                 layer_idx: int, mlp_ratio: float = 4.0, qkv_bias: bool = True, dropout: float = 0.0,
                 attention_dropout: float = 0.0, drop_path: float = 0.0, layer_norm_eps: float = 1e-5,
                 activation: str = "gelu", downsample: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.resolution = resolution
        # A map no larger than a window is one window, and shifting it would change nothing.
        window = window_size
        if min(resolution) <= window_size:
            window, shift = min(resolution), False
        self.window = window
        self.shift = window // 2 if shift else 0
        self.ln1 = LayerNorm(dim, eps=layer_norm_eps)
        self.attn = WindowAttention(dim, num_heads, window, table_window=window_size, qkv_bias=qkv_bias,
                                    attention_dropout=attention_dropout, dropout=dropout)
        self.ln2 = LayerNorm(dim, eps=layer_norm_eps)
        self.mlp = MLP(dim, int(dim * mlp_ratio), activation=activation, bias=True, dropout=dropout)
        self.drop_path = DropPath(drop_path)
        self.downsample = PatchMerging(dim, resolution) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H, W = self.resolution
        B, L, C = x.shape
        if L != H * W:
            raise ValueError(f"Swin block {self.layer_idx}: expected {H}x{W} = {H * W} tokens, got {L}")
        w, s = self.window, self.shift
        h = self.ln1(x).view(B, H, W, C)
        pad_b, pad_r = (w - H % w) % w, (w - W % w) % w
        h = nn.functional.pad(h, (0, 0, 0, pad_r, 0, pad_b))  # (B, Hp, Wp, C)
        Hp, Wp = H + pad_b, W + pad_r
        mask = None
        if s:
            h = torch.roll(h, shifts=(-s, -s), dims=(1, 2))
            mask = shifted_window_mask(Hp, Wp, w, s, device=x.device).to(h.dtype)
        h = self.attn(window_partition(h, w), mask)  # (B * nW, w*w, C)
        h = window_merge(h, w, Hp, Wp)
        if s:
            h = torch.roll(h, shifts=(s, s), dims=(1, 2))
        h = h[:, :H, :W].reshape(B, L, C)
        x = x + self.drop_path(h)
        x = x + self.drop_path(self.mlp(self.ln2(x)))
        return self.downsample(x) if self.downsample is not None else x


class SwinEmbeddings(nn.Module):
    def __init__(self, image_size, patch_size, num_channels: int, embed_dim: int, dropout: float = 0.0,
                 use_absolute_embeddings: bool = False):
        super().__init__()
        self.patch_embed = PatchEmbedding(image_size, patch_size, num_channels, embed_dim)
        self.norm = LayerNorm(embed_dim)
        self.position_embeddings = (nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
                                    if use_absolute_embeddings else None)
        self.drop = nn.Dropout(dropout)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        expected = self.patch_embed.image_size
        if tuple(pixel_values.shape[-2:]) != expected:
            raise ValueError(f"Swin: images are {tuple(pixel_values.shape[-2:])}, but the model was built for "
                             f"image_size {expected}")
        x = self.norm(self.patch_embed(pixel_values))  # (B, N, C)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings
        return self.drop(x)


class SwinForImageClassification(InitByModule, nn.Module):
    """Swin image classifier (as transformers' ``SwinForImageClassification``).

    ``forward(pixel_values, labels=None)``: pixel_values (B, C, H, W), labels (B,) ->
    ``ModelOutput(loss, logits (B, num_labels))``. ``image_size`` must be a multiple of ``patch_size``."""

    pipeline_layout = {"blocks": "blocks", "first": ("embeddings",), "last": ("norm", "classifier")}
    main_input_name = "pixel_values"
    # Windows need the whole 2-D feature map in every block: no sequence parallelism.
    sequence_parallel_unsupported_reason = "Swin's windows and patch merging need the whole feature map in every block"
    context_parallel_unsupported_reason = (
        "its windows and patch merging need the whole feature map in every block")

    def __init__(
        self,
        image_size=224,
        patch_size=4,
        num_channels: int = 3,
        num_labels: int = 1000,
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        window_size: int = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        drop_path_rate: float = 0.1,
        activation: str = "gelu",
        use_absolute_embeddings: bool = False,
        layer_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
    ):
        super().__init__()
        depths, num_heads = list(depths), list(num_heads)
        if len(depths) != len(num_heads):
            raise ValueError(f"Swin: depths {depths} and num_heads {num_heads} must have one entry per stage")
        self.image_size, self.patch_size = pair(image_size), pair(patch_size)
        if self.image_size[0] % self.patch_size[0] or self.image_size[1] % self.patch_size[1]:
            raise ValueError(f"Swin: image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        for i, nh in enumerate(num_heads):
            if (embed_dim * 2 ** i) % nh:
                raise ValueError(f"Swin: stage {i} width {embed_dim * 2 ** i} is not divisible by its {nh} heads")
        self.num_channels = num_channels
        self.num_labels = num_labels
        self.embed_dim = self.hidden_size = embed_dim
        self.depths, self.num_heads = depths, num_heads
        self.window_size = window_size
        self.mlp_ratio = mlp_ratio
        self.num_layers = sum(depths)
        self.num_features = embed_dim * 2 ** (len(depths) - 1)
        self.layer_norm_eps = layer_norm_eps
        self.drop_path_rate = drop_path_rate
        self.initializer_range = initializer_range
        self.return_dict = True

        self.embeddings = SwinEmbeddings(image_size, patch_size, num_channels, embed_dim, hidden_dropout,
                                         use_absolute_embeddings)
        resolution = self.embeddings.patch_embed.grid_size
        rates = [drop_path_rate * i / max(self.num_layers - 1, 1) for i in range(self.num_layers)]
        blocks, i = {}, 0
        for stage, (depth, nh) in enumerate(zip(depths, num_heads)):
            for j in range(depth):
                last_of_stage = j == depth - 1 and stage < len(depths) - 1
                blocks[str(i)] = SwinBlock(
                    embed_dim * 2 ** stage, resolution, nh, window_size, shift=j % 2 == 1, layer_idx=i,
                    mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, dropout=hidden_dropout,
                    attention_dropout=attention_dropout, drop_path=rates[i], layer_norm_eps=layer_norm_eps,
                    activation=activation, downsample=last_of_stage,
                )
                i += 1
            resolution = ((resolution[0] + 1) // 2, (resolution[1] + 1) // 2)
        self.blocks = nn.ModuleDict(blocks)
        self.norm = LayerNorm(self.num_features, eps=layer_norm_eps)
        self.classifier = Linear(self.num_features, num_labels, bias=True)  # replicated: a small head
        self.finish_init()

    def stage_of_block(self) -> list[int]:
        """The stage (0, 1, ...) of every block, in block order."""
        return [s for s, d in enumerate(self.depths) for _ in range(d)]

    def init_module(self, name: str, module: nn.Module) -> None:
        """Truncated N(0, 0.02) for projections and the relative-bias tables, zero biases, unit norms."""
        std = self.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d, HeadwiseEmbedding)):
            init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, SwinEmbeddings) and module.position_embeddings is not None:
            init.trunc_normal_(module.position_embeddings, std=std, a=-2 * std, b=2 * std)

    def forward(self, pixel_values: torch.Tensor, labels: Optional[torch.Tensor] = None):
        """On an inner pipeline stage ``pixel_values`` are the hidden states (B, H*W, C) of its first block."""
        h = self.embeddings(pixel_values) if self.embeddings is not None else pixel_values
        for block in self.blocks.values():
            h = block(h)
        if self.norm is None:
            return h if not self.return_dict else ModelOutput(last_hidden_state=h)
        h = self.norm(h)
        logits = self.classifier(h.mean(dim=1))  # average over tokens: (B, num_labels)
        if not self.return_dict and labels is None:
            return logits
        loss = classification_loss(logits, labels) if labels is not None else None
        return ModelOutput(loss=loss, logits=logits)


SwinForImageClassification.pipeline_loss = staticmethod(classification_loss)


def count_swin_parameters(image_size: int, patch_size: int, num_channels: int, num_labels: int, embed_dim: int,
                          depths: Sequence[int], num_heads: Sequence[int], window_size: int,
                          mlp_ratio: float = 4.0) -> int:
    """The parameter count from the sizes (Swin-T at 224 with 1000 classes: 28,288,354)."""
    C = embed_dim
    total = num_channels * patch_size * patch_size * C + C + 2 * C  # patch conv (+ bias), its LayerNorm
    for stage, (depth, nh) in enumerate(zip(depths, num_heads)):
        dim, hidden, w = C * 2 ** stage, int(C * 2 ** stage * mlp_ratio), window_size
        # q, k, v, out (+ biases); fc1, fc2 (+ biases); two LayerNorms; the (2w-1)^2 x heads bias table
        block = 4 * (dim * dim + dim) + (dim * hidden + hidden) + (hidden * dim + dim) + 4 * dim
        total += depth * (block + (2 * w - 1) ** 2 * nh)
        if stage < len(depths) - 1:
            total += 4 * dim * 2 * dim + 2 * 4 * dim  # patch merging: reduction (no bias) + LayerNorm(4C)
    F_ = C * 2 ** (len(depths) - 1)
    return total + 2 * F_ + F_ * num_labels + num_labels  # final LayerNorm, classifier
