"""Materialise a model that was built on the meta device and already parallelized.

House style 5 (torchtitan, picotron): build on ``meta``, split into pipeline stages, apply TP/FSDP, and
only then allocate — each rank allocates just the shards it holds. Filling those shards must give the same
numbers as a single-device run, so values are defined per *full* tensor and each rank keeps its slice:

* **random initialisation**: for every module the model part holds, a full-size copy of just that module's
  own parameters and buffers is made on the CPU, and the family's ``init_module(name, module)`` rule
  (:mod:`dufu.models.base`) fills it under a seed derived from the run's seed and the module's name. The
  values therefore depend neither on the layout nor on which modules a pipeline stage keeps, nor on the
  device (CPU generator). Peak extra memory: the largest single module's parameters.
* **pretrained weights** (``model.pretrained`` or ``pretrained_model``): the family's Hugging Face adapter
  (or a dufu checkpoint) is asked only for the names this part holds, and reads one tensor at a time; those
  tensors are not initialised first.
* each full tensor is cut to this rank's shard with ``distribute_tensor(..., src_data_rank=None)``: the
  DTensor's own placements (TP ``Shard``, FSDP ``Shard``/``_StridedShard``) decide the slice locally, with
  no communication, since every rank computes the same full value.

A tied output head on the last pipeline stage (a copy of the first stage's embedding) takes its twin's
value: names are resolved to the canonical parameter of the unsplit ``reference`` model.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from dufu.models.base import contract_of
from dufu.models.hub import check_source_shape


# Placements whose local tensor is one block of the full tensor (torch's own offset arithmetic, as DCP uses).
_BLOCK_PLACEMENTS = (Shard, Replicate, _StridedShard)


def module_seed(seed: int, name: str) -> int:
    """A seed for one module's initialisation, a function of the run's seed and the module's name only."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def supports_meta_init(model: nn.Module) -> bool:
    """True for models with a per-module initialisation rule (every dufu family)."""
    return callable(contract_of(model).init_module)


def _full_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` that owns fresh CPU tensors of the full (global) shapes of its own
    parameters and buffers, and no children: what ``init_module`` may touch."""
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__ = dict(module.__dict__)
    clone._parameters = {
        n: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for n, p in module._parameters.items()
    }
    clone._buffers = {n: None if b is None else torch.empty(b.shape, dtype=b.dtype) for n, b in module._buffers.items()}
    clone._modules = {}
    return clone


class ModuleInitializer:
    """Full-size initial values of one module's own tensors, computed once per module name."""

    def __init__(self, reference: nn.Module, seed: int):
        self.reference = reference
        self.seed = seed
        self.modules = dict(reference.named_modules())
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def values(self, module_name: str) -> dict[str, torch.Tensor]:
        if module_name not in self._cache:
            clone = _full_copy(self.modules[module_name])
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(self.seed, module_name))
                own_rule = getattr(clone, "init_own", None)  # a module that knows its values (a LoRA factor)
                own_rule() if callable(own_rule) else self.reference.init_module(module_name, clone)
            self._cache = {module_name: {**clone._parameters, **clone._buffers}}  # keep only the latest
        return self._cache[module_name]


def _canonical_names(reference: nn.Module) -> dict[str, str]:
    """Every parameter name of ``reference`` -> the first name of the same tensor (tied heads -> embedding)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


@torch.no_grad()
def assign_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor ``full`` into ``target``: a plain tensor, or this rank's shard of a DTensor."""
    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def _local_block(target: torch.Tensor) -> Optional[tuple[slice, ...]]:
    """The block of the full tensor that ``target`` holds on this rank, as slices: for a DTensor sharded by TP
    (``Shard``), FSDP (``Shard``), both (FSDP's ``_StridedShard`` within the TP shard: still one contiguous
    block) or replicated. None for anything else (a plain tensor, ``Partial``), which is read whole."""
    if not isinstance(target, DTensor) or not all(type(p) in _BLOCK_PLACEMENTS for p in target.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _split_name(qualified: str) -> tuple[str, str]:
    module, _, leaf = qualified.rpartition(".")
    return module, leaf


@torch.no_grad()
def materialize_(
    part: nn.Module,
    reference: nn.Module,
    device: torch.device,
    *,
    seed: int,
    pretrained: Optional[Callable[[nn.Module], tuple[str, Mapping]]] = None,
    init_parameters: bool = True,
) -> nn.Module:
    """Allocate ``part`` (a meta-built, possibly parallelized model or pipeline stage) on ``device`` and fill
    it: the tensors ``pretrained`` provides, if given, and initial values from ``reference.init_module``
    (``reference``: the unsplit meta model) for the rest. ``pretrained(part)`` returns ``(what, source)``:
    ``source`` maps parameter names to tensors or zero-argument callables that read one (see
    :func:`dufu.engine.weights.pretrained.pretrained_source`); ``init_parameters=False`` leaves parameters unset (only buffers
    are computed) for a caller that loads every one of them next (a resumed checkpoint, whose strict load
    fails on any it lacks). A source value that already is a DTensor is the part's own
    (a new task head keeping its initialisation) and is left alone."""
    part.to_empty(device=device)
    contract_of(part).tie_weights()
    what, source = pretrained(part) if pretrained is not None else ("", {})
    own = part.state_dict()  # after the source: an adapter may untie a head (T5), giving it its own tensor
    # A source value that is the part's own tensor (a new task head) keeps its initialisation.
    loaded = {n: v for n, v in source.items()
              if not (isinstance(v, DTensor) or (isinstance(v, torch.Tensor) and v.data_ptr() == own[n].data_ptr()))}
    init = ModuleInitializer(reference, seed)
    canonical = _canonical_names(reference)
    tensors = [(n, t, True) for n, t in part.named_parameters() if n not in loaded and init_parameters]
    tensors += [(n, t, False) for n, t in part.named_buffers()]
    # Group by the (canonical) owning module so each module's initialisation runs once.
    for name, tensor, is_param in sorted(tensors, key=lambda x: _split_name(canonical.get(x[0], x[0]))[0]):
        module_name, leaf = _split_name(canonical.get(name, name) if is_param else name)
        assign_full_(tensor, init.values(module_name)[leaf])
    for name, value in loaded.items():  # pretrained weights: read one at a time, only this part's names
        index = _local_block(own[name]) if hasattr(value, "read_slice") else None
        if index is not None:  # only this rank's block of the stored tensor is read
            check_source_shape(what, part, name, torch.empty(value.shape, device="meta"), own[name])
            own[name].to_local().copy_(value.read_slice(index))
            continue
        value = value() if callable(value) else value
        check_source_shape(what, part, name, value, own[name])
        assign_full_(own[name], value)
    if loaded:
        contract_of(part).tie_weights()
    return part
