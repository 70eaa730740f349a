"""Materialise a model that was built on the meta device and already parallelized.

House style 5 (torchtitan, picotron): build on ``meta``, split into pipeline stages, apply TP/FSDP, and
only then allocate — each rank allocates just the shards it holds. Filling those shards must give the same
numbers as a single-device run, so values are defined per *full* tensor and each rank keeps its block:

* **random initialisation**: a module's initial values are what the family's ``init_module(name, module)`` rule
  (:mod:`dufu.models.base`) gives a full-size CPU copy of the module's own parameters and buffers under a seed
  derived from the run's seed and the module's name (:class:`ModuleInitializer`). The values therefore depend
  neither on the layout nor on which modules a pipeline stage keeps, nor on the device (CPU generator).
* **pretrained weights** (``model.pretrained`` or ``pretrained_model``): the family's Hugging Face adapter
  (or a dufu checkpoint) is asked only for the names this part holds, and reads one tensor at a time; those
  tensors are not initialised first.
* a rank keeps its block of each full tensor locally, with no communication, since every rank computes the
  same values: for TP ``Shard``, FSDP ``Shard``/``_StridedShard`` and replicas the block is indexed out of the
  values on the CPU (torch's offset arithmetic, as DCP uses) and only it is converted and copied to the device;
  other placements go through ``distribute_tensor(..., src_data_rank=None)``.

What is and is not sharded:

* device memory and host-to-device traffic: sharded. A rank's device receives its block only; no full-size
  copy of a sharded tensor is made on the device.
* host memory: bounded, not proportional to a module. Where the rule only draws (``normal_``, ``uniform_``) or
  fills (``fill_``, ``zero_``) the module's own fp32 tensors - the matrices, embeddings, norms and biases of
  GPT and Llama (tests/parallel/test_materialize.py) - the rule is recorded once on meta copies and its
  draws replayed under the same seed ``CHUNK_ELEMENTS`` (16 MiB of fp32) at a time, each chunk's part of the
  rank's block copied on; the full tensor never exists. Other modules (the rotary tables, computed; grouped
  MoE experts, whose rule skips meta tensors; other dtypes) are computed whole on the CPU as before: peak extra
  host memory, the largest such module's own tensors.
* CPU time: not sharded. Every rank draws every module's full stream of random numbers, because the values are
  the single-device run's and torch's CPU generator (Mersenne Twister) cannot skip ahead: the numbers of a block
  depend on all those drawn before them. Generating only a shard's numbers needs a counter-based, per-block
  seeded initialisation, i.e. other initial values than a single-device run has today.

Replaying chunk by chunk gives the whole-tensor numbers because of how torch's CPU kernels draw
(:func:`_row_chunks`); :func:`_chunks_draw_as_whole` checks that on the torch in use, and where it fails every
module is computed whole.

A tied output head on the last pipeline stage (a copy of the first stage's embedding) takes its twin's
value: names are resolved to the canonical parameter of the unsplit ``reference`` model.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

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


def _full_copy(module: nn.Module, device: str = "cpu") -> nn.Module:
    """A shallow copy of ``module`` that owns fresh tensors of the full (global) shapes of its own parameters
    and buffers on ``device`` (the CPU; ``meta`` to record a rule), and no children: what ``init_module`` may
    touch."""
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


# ------------------------------------------------------------------ initial values drawn chunk by chunk

# Elements drawn at once when a module's values are streamed (16 MiB of fp32): the host memory initialisation
# needs, instead of the module's full size.
CHUNK_ELEMENTS = 1 << 22
_STREAMED_DTYPES = (torch.float32, torch.float64)
_aten = torch.ops.aten
_REPLAYABLE = {_aten.normal_.default: "normal", _aten.uniform_.default: "uniform", _aten.fill_.Scalar: "fill",
               _aten.zero_.default: "zero"}


class _InitRecorder(TorchDispatchMode):
    """The in-place initialisations (normal_, uniform_, fill_, zero_) a rule applies to a module's own tensors,
    in order, seen on meta copies of them; anything else the rule computes makes the module unreplayable."""

    def __init__(self, own: dict):
        super().__init__()
        self.own = own  # TensorImpl address -> leaf name
        self.ops: list[tuple[str, str, tuple]] = []
        self.other: Optional[str] = None  # the first operation that is not a replayable initialisation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _REPLAYABLE.get(func)
        leaf = self.own.get(args[0]._cdata) if args and isinstance(args[0], torch.Tensor) else None
        if kind is None or leaf is None or kwargs.get("generator") is not None:
            self.other = self.other or str(func)
        elif kind == "normal":
            self.ops.append((leaf, kind, (_arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0))))
        elif kind == "uniform":
            self.ops.append((leaf, kind, (_arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0))))
        else:
            self.ops.append((leaf, kind, (_arg(args, kwargs, 1, "value", 0.0),)))
        return func(*args, **kwargs)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _row_chunks(shape: tuple, chunk_elements: int) -> list[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` of dim 0 that cut a tensor of ``shape`` into chunks of about ``chunk_elements``.

    Every chunk but the last starts and ends on a multiple of 16 elements, and the last holds at least 16 (or the
    tensor is one chunk). Cut this way, torch's CPU ``normal_`` draws the same numbers chunk by chunk as for the
    whole tensor: it draws one uniform number per element in order, turns them into normal ones in blocks of 16
    (Box-Muller), and when the size is no multiple of 16 draws 16 more for the last 16 elements
    (ATen/native/cpu/DistributionTemplates.h, ``normal_fill``); ``uniform_`` draws one number per element in
    order. :func:`_chunks_draw_as_whole` checks it on the torch in use."""
    rows = shape[0] if shape else 1
    row = math.prod(shape[1:])
    if rows * row < 16:
        return [(0, rows)]
    step = 16 // math.gcd(row, 16)  # rows in a whole number of 16-element blocks
    per = max(step, chunk_elements // max(row, 1) // step * step)
    cuts = [*range(0, rows, per), rows]
    if len(cuts) > 2 and (cuts[-1] - cuts[-2]) * row < 16:
        cuts.pop(-2)  # a last chunk under 16 elements joins the one before
    return list(zip(cuts[:-1], cuts[1:]))


def _draw(buffer: torch.Tensor, kind: str, args: tuple) -> torch.Tensor:
    if kind == "normal":
        return buffer.normal_(*args)
    if kind == "uniform":
        return buffer.uniform_(*args)
    return buffer.fill_(args[0] if kind == "fill" else 0)


@functools.lru_cache(maxsize=None)
def _chunks_draw_as_whole() -> bool:
    """Whether, on this torch, drawing a tensor chunk by chunk (:func:`_row_chunks`) gives the numbers of one
    draw of the whole tensor; where not, every module is computed whole."""
    shape = (37, 24)  # 888 elements: the last 16 are drawn again; chunks of 4 rows (96 elements)
    with torch.random.fork_rng(devices=[]):
        for kind, args in (("normal", (0.0, 0.02)), ("uniform", (-0.1, 0.1))):
            torch.manual_seed(0)
            whole = _draw(torch.empty(shape), kind, args)
            torch.manual_seed(0)
            chunks = [_draw(torch.empty(r1 - r0, shape[1]), kind, args) for r0, r1 in _row_chunks(shape, 100)]
            if len(chunks) < 3 or not torch.equal(whole, torch.cat(chunks)):
                return False
    return True


def _block_of(target: torch.Tensor) -> Optional[tuple[slice, ...]]:
    """The block of the full tensor ``target`` holds: all of it for a plain tensor."""
    if isinstance(target, DTensor):
        return _local_block(target)
    return tuple(slice(0, n) for n in target.shape)


class ModuleInitializer:
    """Initial values of one module's own tensors, as the single-device run has them: ``init_module`` (or the
    module's ``init_own``) run once on a full-size copy of the module, under the module's seed.

    :meth:`values` computes them whole; :meth:`assign` fills a rank's tensors with their blocks, drawing the
    values chunk by chunk where the rule only draws (``normal_``, ``uniform_``) or fills (``fill_``, ``zero_``)
    the module's own fp32 tensors: the rule is run once on meta copies to record what it does, and the recorded
    draws are replayed under the same seed, ``CHUNK_ELEMENTS`` at a time, each chunk's part of the rank's block
    copied to the device. Any other rule (values computed from others, a tensor the rule leaves alone on the meta
    device, another dtype) gets its module computed whole, as :meth:`values` does."""

    def __init__(self, reference: nn.Module, seed: int):
        self.reference = reference
        self.seed = seed
        self.modules = dict(reference.named_modules())
        self._cache: dict[str, dict[str, torch.Tensor]] = {}
        self.streamed: list[str] = []  # the modules assign() drew chunk by chunk (the others were computed whole)

    def _run_rule(self, module_name: str, clone: nn.Module) -> None:
        own_rule = getattr(clone, "init_own", None)  # a module that knows its values (a LoRA factor)
        own_rule() if callable(own_rule) else self.reference.init_module(module_name, clone)

    @torch.no_grad()
    def values(self, module_name: str) -> dict[str, torch.Tensor]:
        if module_name not in self._cache:
            clone = _full_copy(self.modules[module_name])
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(self.seed, module_name))
                self._run_rule(module_name, clone)
            self._cache = {module_name: {**clone._parameters, **clone._buffers}}  # keep only the latest
        return self._cache[module_name]

    @torch.no_grad()
    def assign(self, module_name: str, targets: dict[str, list[torch.Tensor]]) -> None:
        """Fill ``targets`` (leaf name -> this rank's tensors of it: plain, or DTensor shards; a tied copy makes
        two) with the module's initial values."""
        ops = self._recorded(module_name, targets)
        if ops is None:
            values = self.values(module_name)
            for leaf, tensors in targets.items():
                for target in tensors:
                    assign_full_(target, values[leaf])
            return
        module = self.modules[module_name]
        own = {**module._parameters, **module._buffers}
        last = {leaf: i for i, (leaf, _, _) in enumerate(ops)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(self.seed, module_name))
            for i, (leaf, kind, args) in enumerate(ops):
                # (this rank's tensor, the block of the full tensor it holds); earlier draws are only consumed
                dests = [(t.to_local() if isinstance(t, DTensor) else t, _block_of(t))
                         for t in (targets.get(leaf, []) if last[leaf] == i else [])]
                shape, dtype = tuple(own[leaf].shape), own[leaf].dtype
                if kind in ("fill", "zero"):  # no random numbers drawn
                    for local, _ in dests:
                        _draw(local, kind, args)
                    continue
                for r0, r1 in _row_chunks(shape, CHUNK_ELEMENTS):
                    chunk = _draw(torch.empty((r1 - r0, *shape[1:]) if shape else (), dtype=dtype), kind, args)
                    for local, block in dests:
                        if not shape:
                            local.copy_(chunk)
                            continue
                        lo, hi = max(r0, block[0].start), min(r1, block[0].stop)
                        if lo < hi:  # this chunk's rows of the rank's block
                            rows = chunk[(slice(lo - r0, hi - r0), *block[1:])]
                            local[lo - block[0].start:hi - block[0].start].copy_(rows)
        self.streamed.append(module_name)

    def _recorded(self, module_name: str, targets: dict) -> Optional[list]:
        """The rule's initialisations of the module's own tensors, replayable chunk by chunk; None where the
        module has to be computed whole."""
        module = self.modules[module_name]
        own = {n: t for n, t in {**module._parameters, **module._buffers}.items() if t is not None}
        if (not all(t.dtype in _STREAMED_DTYPES for t in own.values())
                or not all(_block_of(t) is not None for ts in targets.values() for t in ts)
                or not _chunks_draw_as_whole()):
            return None
        clone = _full_copy(module, device="meta")
        tensors = {**clone._parameters, **clone._buffers}
        recorder = _InitRecorder({t._cdata: n for n, t in tensors.items() if t is not None})
        with recorder:  # meta tensors: nothing is drawn, nothing needs a seed
            self._run_rule(module_name, clone)
        unchanged = all(clone._parameters.get(n) is t or clone._buffers.get(n) is t for n, t in tensors.items())
        done = {leaf for leaf, _, _ in recorder.ops}
        if recorder.other is not None or not unchanged or not set(targets) <= done:
            return None
        return recorder.ops


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
