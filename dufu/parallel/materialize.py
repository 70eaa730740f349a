"""Materialise a model that was built on the meta device and already parallelized.

House style 5 (torchtitan, picotron): build on ``meta``, split into pipeline stages, apply TP/FSDP, and
only then allocate — each rank allocates just the shards it holds. Filling those shards must give the same
numbers as a single-device run, so values are defined per *full* tensor and each rank fills its block:

* **random initialisation**: a module's initial values are what the family's ``init_module(name, module)`` rule
  (:mod:`dufu.models.base`) gives the module's own parameters and buffers under a seed derived from the run's
  seed and the module's name (:func:`dufu.layers.init.module_seed`, :class:`ModuleInitializer`), the values
  ``init_weights(seed)`` gives a model built on one device. The rules draw through :mod:`dufu.layers.init`,
  which defines a tensor's values tile by tile, each tile from its own seeded generator: a rank draws only the
  tiles its block overlaps. The values therefore depend neither on the layout, nor on which modules a pipeline
  stage keeps, nor on the device (CPU generators).
* **pretrained weights** (``model.pretrained`` or ``pretrained_model``): the family's Hugging Face adapter
  (or a dufu checkpoint) is asked only for the names this part holds, and reads one tensor at a time; those
  tensors are not initialised first.
* a rank's block of each full tensor needs no communication, since every rank computes the same values: for TP
  ``Shard``, FSDP ``Shard``/``_StridedShard`` and replicas the block is located by torch's offset arithmetic (as
  DCP uses); other placements go through ``distribute_tensor(..., src_data_rank=None)`` on the full values.

What is and is not sharded, where the rule only calls :mod:`dufu.layers.init` on the module's own tensors (the
matrices, embeddings, norms and biases of every dufu family, grouped MoE experts included;
tests/parallel/test_materialize.py): the rule runs once on a meta copy of the module with the rank's blocks as
the destinations, so

* device memory and host-to-device traffic: the rank's blocks only;
* host memory: one tile (256 x 256) at a time; the full tensor never exists;
* CPU time: the tiles the rank's blocks overlap, 1 / (number of shards) of the numbers where the blocks' edges
  fall on the tile grid, and a part of a tile more at each edge that does not.

Any other rule (values computed from others, such as the rotary tables; a rule that draws from torch's default
generator, such as a delta adapter's) gets its module computed whole on the CPU under the module's seed, and the
rank's block copied on: peak extra host memory, the largest such module's own tensors.

A tied output head on the last pipeline stage (a copy of the first stage's embedding) takes its twin's
value: names are resolved to the canonical parameter of the unsplit ``reference`` model.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dufu.layers.init import init_scope, module_seed
from dufu.models.base import contract_of
from dufu.models.hub import check_source_shape

__all__ = ["ModuleInitializer", "assign_full_", "materialize_", "module_seed", "supports_meta_init"]

# Placements whose local tensor is one block of the full tensor (torch's own offset arithmetic, as DCP uses).
_BLOCK_PLACEMENTS = (Shard, Replicate, _StridedShard)


def supports_meta_init(model: nn.Module) -> bool:
    """True for models with a per-module initialisation rule (every dufu family)."""
    return callable(contract_of(model).init_module)


def _full_copy(module: nn.Module, device: str = "cpu") -> nn.Module:
    """A shallow copy of ``module`` that owns fresh tensors of the full (global) shapes of its own parameters
    and buffers on ``device`` (the CPU; ``meta`` to run the rule with blocks as destinations), and no children:
    what ``init_module`` may touch."""
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__ = dict(module.__dict__)
    clone._parameters = {
        n: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                               requires_grad=p.requires_grad)
        for n, p in module._parameters.items()
    }
    clone._buffers = {n: None if b is None else torch.empty(b.shape, dtype=b.dtype, device=device)
                      for n, b in module._buffers.items()}
    clone._modules = {}
    return clone


class _OwnTensorGuard(TorchDispatchMode):
    """Notes whether any operation touches one of a module's own (meta) tensors: a rule that does anything to
    them other than through :mod:`dufu.layers.init` (which, given blocks, never touches them) cannot be run
    block by block."""

    def __init__(self, own: list[torch.Tensor]):
        super().__init__()
        self.own = {t._cdata for t in own}
        self.touched: Optional[str] = None  # the first such operation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.touched is None and any(isinstance(a, torch.Tensor) and a._cdata in self.own
                                        for a in tree_flatten((args, kwargs))[0]):
            self.touched = str(func)
        return func(*args, **kwargs)


def _block_of(target: torch.Tensor) -> Optional[tuple[slice, ...]]:
    """The block of the full tensor ``target`` holds: all of it for a plain tensor; None for a placement that
    is not one block (``Partial``)."""
    if isinstance(target, DTensor):
        return _local_block(target)
    return tuple(slice(0, n) for n in target.shape)


class ModuleInitializer:
    """Initial values of one module's own tensors, as the single-device run has them: ``init_module`` (or the
    module's ``init_own``) run on the module under :func:`dufu.layers.init.init_scope` with the module's seed.

    :meth:`values` computes them whole, on a full-size CPU copy of the module; :meth:`assign` fills a rank's
    tensors with their blocks: the rule runs once on a meta copy with those blocks as the destinations of its
    :mod:`dufu.layers.init` calls, which draw only the tiles the blocks overlap. A rule that does anything else
    to the module's tensors (:class:`_OwnTensorGuard`), leaves one of them unset or replaces one gets its module
    computed whole, as :meth:`values` does, and the blocks copied from it."""

    def __init__(self, reference: nn.Module, seed: int):
        self.reference = reference
        self.seed = seed
        self.modules = dict(reference.named_modules())
        self._cache: dict[str, dict[str, torch.Tensor]] = {}
        self.by_block: list[str] = []  # the modules assign() filled block by block (the others were computed whole)

    def _run_rule(self, module_name: str, clone: nn.Module) -> None:
        own_rule = getattr(clone, "init_own", None)  # a module that knows its values (a LoRA factor)
        own_rule() if callable(own_rule) else self.reference.init_module(module_name, clone)

    @torch.no_grad()
    def values(self, module_name: str) -> dict[str, torch.Tensor]:
        if module_name not in self._cache:
            clone = _full_copy(self.modules[module_name])
            with init_scope(module_seed(self.seed, module_name), clone):
                self._run_rule(module_name, clone)
            self._cache = {module_name: {**clone._parameters, **clone._buffers}}  # keep only the latest
        return self._cache[module_name]

    @torch.no_grad()
    def assign(self, module_name: str, targets: dict[str, list[torch.Tensor]]) -> None:
        """Fill ``targets`` (leaf name -> this rank's tensors of it: plain, or DTensor shards; a tied copy makes
        two) with the module's initial values."""
        if self._assign_blocks(module_name, targets):
            self.by_block.append(module_name)
            return
        values = self.values(module_name)
        for leaf, tensors in targets.items():
            for target in tensors:
                assign_full_(target, values[leaf])

    def _assign_blocks(self, module_name: str, targets: dict[str, list[torch.Tensor]]) -> bool:
        """Run the rule on a meta copy of the module with the targets' blocks as destinations; False (targets
        to be filled again from the whole values) where that does not define every target."""
        blocks = {leaf: [(t.to_local() if isinstance(t, DTensor) else t, _block_of(t)) for t in tensors]
                  for leaf, tensors in targets.items()}
        if any(block is None for dests in blocks.values() for _, block in dests):
            return False
        clone = _full_copy(self.modules[module_name], device="meta")
        own = {n: t for n, t in {**clone._parameters, **clone._buffers}.items() if t is not None}
        guard = _OwnTensorGuard(list(own.values()))
        with guard, init_scope(module_seed(self.seed, module_name), clone, blocks) as scope:
            self._run_rule(module_name, clone)
        unchanged = all(clone._parameters.get(n, clone._buffers.get(n)) is t for n, t in own.items())
        return guard.touched is None and not scope.unknown and unchanged and set(targets) <= scope.done


def _canonical_names(reference: nn.Module) -> dict[str, str]:
    """Every parameter name of ``reference`` -> the first name of the same tensor (tied heads -> embedding)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


@torch.no_grad()
def assign_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor ``full`` (on any device; initial values are on the CPU) into ``target``: a plain
    tensor, or this rank's shard of a DTensor. For a DTensor whose local tensor is one block of the full one (TP
    and FSDP shards, replicas) only that block is converted and crosses to the target's device; any other
    placement goes through ``distribute_tensor`` on the full tensor."""
    if not isinstance(target, DTensor):
        target.copy_(full)  # copy_ converts dtype and device, as .to() would
        return
    block = _local_block(target)
    if block is not None:
        target.to_local().copy_(full[block])
        return
    full = full.to(device=target.device, dtype=target.dtype)
    local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    target.to_local().copy_(local)


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
    :func:`dufu.engine.weights.pretrained.pretrained_source`); ``init_parameters=False`` leaves parameters unset
    (only buffers are computed) for a caller that loads every one of them next (a resumed checkpoint, whose strict load
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
    by_module: dict[str, dict[str, list[torch.Tensor]]] = {}
    for name, tensor, is_param in tensors:
        module_name, leaf = _split_name(canonical.get(name, name) if is_param else name)
        by_module.setdefault(module_name, {}).setdefault(leaf, []).append(tensor)  # a tied copy: two tensors
    for module_name, targets in by_module.items():
        init.assign(module_name, targets)
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
