"""The random initial values of dufu's models, defined tile by tile so that any block of a tensor can be computed
alone, with the same numbers as the whole tensor.

**The definition.** ``normal_(tensor, mean, std)`` (and :func:`uniform_`, :func:`trunc_normal_`) cuts the tensor
into a fixed grid of tiles (:func:`tile_shape`: 256 x 256 over the last two dims and one index of every leading
dim; 65536 elements of a 1-D tensor; one tile for a scalar) and gives each tile the values torch's own
``nn.init`` rule draws on a fresh fp32 tile (fp64 for an fp64 tensor) with a ``torch.Generator`` of its own,
seeded from (the module's seed, the tensor's name in its module, the tile's index) (:func:`tile_seed`). No tile's
numbers depend on another's, so whoever holds a block of the tensor (a tensor-parallel or FSDP shard) draws only
the tiles that block overlaps, cuts them at its edges, and holds exactly that block of the whole tensor. A single
stream over the whole tensor cannot give that: torch's CPU generator (Mersenne Twister) cannot skip ahead, so
every rank would have to draw every number before its own. The mean, std and truncation are the caller's; only
the random stream is defined here.

**The key.** A family's ``init_module(name, module)`` rule calls these functions on the module's own tensors; the
seed and the tensors' names come from the scope the rule runs in (:func:`init_scope`), which
``InitByModule.init_weights`` (a model built on a real device) and :mod:`dufu.parallel.materialize` (a model built
on the meta device, each rank filling its blocks) both open with ``module_seed(run seed, module name)``: the
values are the same on one device and in every parallel layout. In a scope opened with ``blocks``, a call writes
only those blocks (of a meta copy's full-size tensors) and never touches the tensor it is given. Called outside
any scope (a layer's constructor), a call draws its seed from torch's default generator.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

TILE = 256  # rows and columns of a tile of a matrix (the last two dims)
TILE_1D = TILE * TILE  # elements of a tile of a vector

Block = tuple  # a block of a full tensor: one slice per dim


def module_seed(seed: int, name: str) -> int:
    """A seed for one module's initialisation, a function of the run's seed and the module's name only."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tile_seed(seed: int, leaf: str, index: Sequence[int]) -> int:
    """The seed of one tile: a function of the module's seed, the tensor's name in the module and the tile's
    index in the grid only."""
    return module_seed(seed, f"{leaf}/{','.join(map(str, index))}")


def tile_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The (full) tile of a tensor of ``shape``: (1, ..., 1, TILE, TILE) for two dims or more, (TILE_1D,) for a
    vector, () for a scalar. Tiles at the tensor's far edges are cut to its size."""
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (TILE_1D,)
    return (1,) * (len(shape) - 2) + (TILE, TILE)


def tiles(shape: Sequence[int], block: Optional[Block] = None) -> Iterator[tuple[tuple[int, ...], Block]]:
    """(index, the tile's slices of the full tensor) of every tile of a tensor of ``shape`` that overlaps
    ``block`` (default: the whole tensor), in order."""
    block = tuple(slice(0, n) for n in shape) if block is None else block
    sizes = tile_shape(shape)
    ranges = [range(b.start // t, -(-b.stop // t)) if b.stop > b.start else range(0)
              for b, t in zip(block, sizes)]
    for index in itertools.product(*ranges):
        yield index, tuple(slice(i * t, min((i + 1) * t, n)) for i, t, n in zip(index, sizes, shape))


def _draw_tile(rule: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, args: tuple) -> torch.Tensor:
    """One tile's values: torch's ``nn.init`` ``rule`` on a fresh CPU tile with its own generator. The only
    place initial random numbers are drawn."""
    tile = torch.empty(shape, dtype=dtype, device="cpu")
    return getattr(nn.init, rule)(tile, *args, generator=torch.Generator(device="cpu").manual_seed(seed))


@dataclass
class _Scope:
    seed: int
    names: dict[int, str]  # id(tensor) -> its name in the module
    # None: fill the tensors themselves; else leaf name -> [(a tensor holding a block, that block)]
    blocks: Optional[Mapping[str, list[tuple[torch.Tensor, Block]]]] = None
    done: set[str] = field(default_factory=set)  # the leaves a call of this module wrote
    unknown: bool = False  # a call got a tensor that is not the module's own (blocks cannot be written)


_SCOPE: contextvars.ContextVar[Optional[_Scope]] = contextvars.ContextVar("dufu_init_scope", default=None)


@contextlib.contextmanager
def init_scope(seed: int, module: nn.Module,
               blocks: Optional[Mapping[str, list[tuple[torch.Tensor, Block]]]] = None) -> Iterator[_Scope]:
    """Run a module's initialisation rule with ``seed`` (``module_seed(run seed, module name)``): the calls
    here key their tiles by it and by the name of the module's own tensor they get; torch's default CPU generator
    is seeded with it too (forked: the caller's stream is left as it was), for a rule that draws from it directly.

    ``blocks`` (leaf name -> [(tensor, the block of the full tensor it holds)]): a call on the module's tensor
    ``leaf`` writes only those blocks (``module`` may then be a meta copy); a leaf not listed is not written.
    The scope records the leaves written (``done``) and whether a call got a tensor of another module
    (``unknown``)."""
    names = {id(t): n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None}
    scope = _Scope(seed, names, blocks)
    with torch.random.fork_rng(devices=[]):  # the CPU generator only: a device's stream is left alone
        torch.default_generator.manual_seed(seed)
        token = _SCOPE.set(scope)
        try:
            yield scope
        finally:
            _SCOPE.reset(token)


def fresh_seed() -> int:
    """A seed drawn from torch's default CPU generator (for values defined outside any scope)."""
    return int(torch.randint(0, 2 ** 62, (), device="cpu").item())


def _destinations(tensor: torch.Tensor) -> tuple[Optional[_Scope], str, list[tuple[torch.Tensor, Block]]]:
    """(scope, the tensor's key name, [(tensor to write, the block of the full tensor it holds)])."""
    scope = _SCOPE.get()
    whole = [(tensor, tuple(slice(0, n) for n in tensor.shape))] if not tensor.is_meta else []
    if scope is None:
        return None, "", whole
    leaf = scope.names.get(id(tensor))
    if scope.blocks is None:
        return scope, leaf if leaf is not None else "", whole
    if leaf is None:
        scope.unknown = True
        return scope, "", []
    scope.done.add(leaf)
    # a meta destination (a rehearsal of the layout) holds no values: nothing to draw for it
    return scope, leaf, [(t, b) for t, b in scope.blocks.get(leaf, []) if not t.is_meta]


@torch.no_grad()
def _random_(rule: str, tensor: torch.Tensor, args: tuple) -> torch.Tensor:
    scope, leaf, dests = _destinations(tensor)
    if not dests:
        return tensor
    seed = fresh_seed() if scope is None or (scope.blocks is None and not leaf) else scope.seed
    shape = tuple(tensor.shape)
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    for target, block in dests:
        for index, tile in tiles(shape, block):
            values = _draw_tile(rule, tuple(s.stop - s.start for s in tile), dtype, tile_seed(seed, leaf, index), args)
            both = [slice(max(t.start, b.start), min(t.stop, b.stop)) for t, b in zip(tile, block)]
            source = values[tuple(slice(s.start - t.start, s.stop - t.start) for s, t in zip(both, tile))]
            target[tuple(slice(s.start - b.start, s.stop - b.start) for s, b in zip(both, block))].copy_(source)
    return tensor


def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """``nn.init.normal_``'s distribution, drawn tile by tile (module docstring)."""
    return _random_("normal_", tensor, (mean, std))


def uniform_(tensor: torch.Tensor, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    """``nn.init.uniform_``'s distribution, drawn tile by tile (module docstring)."""
    return _random_("uniform_", tensor, (a, b))


def trunc_normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                  b: float = 2.0) -> torch.Tensor:
    """``nn.init.trunc_normal_``'s distribution, drawn tile by tile (module docstring)."""
    return _random_("trunc_normal_", tensor, (mean, std, a, b))


@torch.no_grad()
def constant_(tensor: torch.Tensor, value: float, rows: Optional[range] = None) -> torch.Tensor:
    """Fill ``tensor`` (only ``rows`` of its dim 0, a step-1 range, if given) with ``value``; in a scope with
    blocks, only the blocks' part of it."""
    _, _, dests = _destinations(tensor)
    for target, block in dests:
        if rows is None or not block:
            target.fill_(value)
            continue
        lo, hi = max(rows.start, block[0].start), min(rows.stop, block[0].stop)
        if lo < hi:
            target[lo - block[0].start:hi - block[0].start].fill_(value)
    return tensor


def zeros_(tensor: torch.Tensor) -> torch.Tensor:
    return constant_(tensor, 0.0)


def ones_(tensor: torch.Tensor) -> torch.Tensor:
    return constant_(tensor, 1.0)


def drawn_elements(shape: Sequence[int], block: Optional[Block] = None) -> int:
    """How many numbers filling ``block`` of a tensor of ``shape`` draws (whole tiles)."""
    return sum(math.prod(s.stop - s.start for s in tile) for _, tile in tiles(shape, block))
