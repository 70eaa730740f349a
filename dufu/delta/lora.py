"""LoRA (Hu et al. 2021) on any dufu model: ``y = W x + b + s * B A dropout(x)`` beside a frozen ``W``.

A targeted linear layer becomes a :class:`LoraLinear` in place: the same module, the same ``weight`` and
``bias`` names (so pretrained loading, checkpoints and the Hugging Face mappings see the base weights where
they were), plus two children holding the factors, ``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r) -
the names PEFT gives them, which keeps its adapter files a rename away. ``s = alpha / r``, or
``alpha / sqrt(r)`` with rank-stabilised scaling (Kalajdzievski 2023, PEFT's ``use_rslora``). Initialisation as
PEFT's default: A Kaiming-uniform (a = sqrt(5), as ``nn.Linear``), B zero, so training starts from the base
model's outputs.

Why by hand and not PEFT's ``LoraModel``: PEFT wraps the layer (``base_layer``) and computes the update in
its own modules, which torch's tensor-parallel styles do not know how to shard; dufu's layers carry their
parallel style as data, and the factors must follow it (Megatron's rule): beside a column-parallel layer, B
is split along its output dimension like the layer and A is replicated; beside a row-parallel layer, A is
split along its input dimension and B is replicated (under sequence parallelism B then acts on this rank's
tokens, and DTensor sums its gradient over the tensor-parallel group). :class:`LoraColwiseParallel` and
:class:`LoraRowwiseParallel` are torch's two styles with that placement of the factors; the forward runs in
DTensor arithmetic, so the update's partial sums are reduced together with the layer's. The adapter files
stay PEFT's own format (:mod:`dufu.delta.peft`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dufu.layers.linear import Linear


class LoraFactor(nn.Module):
    """One LoRA factor: a ``weight`` and the rule that initialises it (used by meta-device materialisation)."""

    def __init__(self, out_features: int, in_features: int, init: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.init = init  # "kaiming" (A) or "zeros" (B)

    @torch.no_grad()
    def init_own(self) -> None:
        if self.init == "zeros":
            nn.init.zeros_(self.weight)
        else:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]} -> {self.weight.shape[0]}, init={self.init}"


class LoraLinear(Linear):
    """A :class:`~dufu.layers.linear.Linear` (or ``nn.Linear``) with LoRA factors; made by :func:`add_lora`."""

    lora_A: LoraFactor
    lora_B: LoraFactor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_merged:
            return F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A.weight), self.lora_B.weight) * self.lora_scaling
        magnitude = getattr(self, "lora_magnitude_vector", None)
        if magnitude is None:
            return F.linear(x, self.weight, self.bias) + update
        # DoRA: m * (W + s B A) x / ||W + s B A|| (row norms), the norm taken as a constant in backward
        # (Liu et al. 2024, section 4.3, as PEFT does)
        scale = magnitude.weight / self.lora_weight_norm().detach()
        y = (F.linear(x, self.weight) + update) * scale
        return y if self.bias is None else y + self.bias

    def lora_weight_norm(self) -> torch.Tensor:
        """The row norms of W + s B A, (out,), in the weight's dtype: DoRA's denominator."""
        w = self.weight
        delta = (self.lora_B.weight @ self.lora_A.weight).to(w.dtype) * self.lora_scaling
        return torch.linalg.vector_norm(w + delta, dim=1)

    @torch.no_grad()
    def merge_lora_(self) -> None:
        """Fold ``s * B A`` into ``weight`` (for serving or export); the factors stay, unused, until unmerged."""
        if getattr(self, "lora_magnitude_vector", None) is not None:
            raise NotImplementedError("merging a DoRA layer in place is not supported; export it merged instead")
        if not self.lora_merged:
            self.weight += (self.lora_B.weight @ self.lora_A.weight).to(self.weight.dtype) * self.lora_scaling
            self.lora_merged = True

    @torch.no_grad()
    def unmerge_lora_(self) -> None:
        if self.lora_merged:
            self.weight -= (self.lora_B.weight @ self.lora_A.weight).to(self.weight.dtype) * self.lora_scaling
            self.lora_merged = False

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora_rank={self.lora_rank}, lora_scaling={self.lora_scaling:g}"


class LoraMagnitude(nn.Module):
    """DoRA's magnitude vector m, (out,). Its initial value is the row norms of the base weight, known only once
    the base weights are in place: :func:`init_dora_magnitudes` sets it (``init_own`` leaves ones for now)."""

    def __init__(self, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features))

    @torch.no_grad()
    def init_own(self) -> None:
        nn.init.ones_(self.weight)


def can_carry_lora(module: nn.Module) -> bool:
    """LoRA wraps exactly ``nn.Linear`` and dufu's ``Linear`` (a subclass may compute something else)."""
    return type(module) in (nn.Linear, Linear)


def add_lora(module: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
             dora: bool = False) -> LoraLinear:
    """Turn ``module`` (an ``nn.Linear`` or dufu ``Linear``, any device incl. meta) into a :class:`LoraLinear`
    in place and return it. The factors are created on the module's device, uninitialised on meta. ``dora``:
    weight-decomposed LoRA (Liu et al. 2024), a trainable magnitude per output feature beside the factors."""
    if not can_carry_lora(module):
        raise TypeError(f"LoRA wraps nn.Linear and dufu Linear layers; got {type(module).__name__}")
    out_features, in_features = module.weight.shape
    if not 0 < rank <= min(in_features, out_features):
        raise ValueError(f"LoRA rank {rank} does not fit a {in_features} -> {out_features} layer: use a rank "
                         f"between 1 and {min(in_features, out_features)}")
    device = module.weight.device
    if not hasattr(module, "parallel"):
        module.parallel = "data"
    module.__class__ = LoraLinear
    with torch.device(device):
        module.lora_A = LoraFactor(rank, in_features, "kaiming")
        module.lora_B = LoraFactor(out_features, rank, "zeros")
        if dora:
            module.lora_magnitude_vector = LoraMagnitude(out_features)
    if device.type != "meta":
        module.lora_A.init_own()
        module.lora_B.init_own()
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.lora_rank, module.lora_alpha, module.lora_rslora = rank, alpha, rslora
    module.lora_scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    module.lora_merged = False
    return module


# ------------------------------------------------------------------------------ tensor parallelism
def _place(module: nn.Module, name: str, mesh, placement, src_data_rank) -> None:
    param = getattr(module, name, None)
    if param is None:
        return
    module.register_parameter(name, nn.Parameter(
        distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank), requires_grad=param.requires_grad))


class LoraColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a :class:`LoraLinear`: weight and bias Shard(0) as torch's; ``lora_B`` Shard(0)
    (its output dimension, like the layer's), ``lora_A`` replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name == "":
            _place(module, "weight", device_mesh, Shard(0), self.src_data_rank)
            _place(module, "bias", device_mesh, Shard(0), self.src_data_rank)
        elif name == "lora_A":
            _place(module, "weight", device_mesh, Replicate(), self.src_data_rank)
        elif name in ("lora_B", "lora_magnitude_vector"):  # output features, split like the layer's
            _place(module, "weight", device_mesh, Shard(0), self.src_data_rank)


class LoraRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a :class:`LoraLinear`: weight Shard(1) and bias replicated as torch's;
    ``lora_A`` Shard(1) (its input dimension, like the layer's), ``lora_B`` replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name == "":
            _place(module, "weight", device_mesh, Shard(1), self.src_data_rank)
            _place(module, "bias", device_mesh, Replicate(), self.src_data_rank)
        elif name == "lora_A":
            _place(module, "weight", device_mesh, Shard(1), self.src_data_rank)
        elif name in ("lora_B", "lora_magnitude_vector"):  # output features: whole on every rank
            _place(module, "weight", device_mesh, Replicate(), self.src_data_rank)


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def merge_lora_(model: nn.Module, unmerge: bool = False) -> Optional[int]:
    """Merge (or unmerge) every LoRA layer of ``model`` in place; returns how many there are."""
    layers = lora_layers(model)
    for m in layers.values():
        m.unmerge_lora_() if unmerge else m.merge_lora_()
    return len(layers)


@torch.no_grad()
def init_dora_magnitudes(parts) -> int:
    """Set every DoRA magnitude to the row norms of its layer's W + s B A (B = 0 at the start: those of W), once
    the base weights are in place and before a checkpoint is resumed; any layout (a sharded weight is gathered
    one layer at a time). Returns how many layers it set."""
    count = 0
    for part in parts:
        for m in part.modules():
            if isinstance(m, LoraLinear) and getattr(m, "lora_magnitude_vector", None) is not None:
                norm = m.lora_weight_norm()
                full = norm.full_tensor() if isinstance(norm, DTensor) else norm
                target = m.lora_magnitude_vector.weight
                if isinstance(target, DTensor):  # this rank's block of the full values, no communication
                    full = distribute_tensor(full.to(target.device), target.device_mesh, target.placements,
                                             src_data_rank=None).to_local()
                    target = target.to_local()
                target.copy_(full.to(target.dtype))
                count += 1
    return count
