"""Generation within a memory budget (BMInf's idea, Han et al. 2022): keep resident what fits, stream the rest.

``load_streaming(source, "2GB")`` builds a decoder on the meta device and materialises only part of it: the
embeddings, the final norm, the head, every buffer, and as many blocks (in order) as the budget holds. Every other
block keeps meta-device parameters; a forward pre-hook gives it its weights read from the memory-mapped
safetensors (:mod:`dufu.engine.inference.streaming_source`) just before it runs, and a forward hook puts the meta tensors
back right after, so nothing references them any more. The model is otherwise unchanged: its blocks, their
names and the attention modules the :class:`dufu.layers.KVCache` is keyed by stay the same objects, so
:func:`dufu.engine.inference.generate.generate` runs it as it is, KV cache included.

What the budget counts (:class:`StreamingPlan`, in the model's dtype, fp32 as ``from_pretrained`` computes):

* resident: the parameters outside the blocks (a tied head once) and all buffers, plus the resident blocks;
* the streaming slot: the largest streamed block. On the CPU its parameters are views of the map (every tensor
  is stored as the model holds it, see :mod:`dufu.engine.inference.streaming_source`): the pages are the file's, mapped while
  the block runs. On another device each is copied there, and the file pages read stay mapped until the block is
  loaded, so those bytes count twice;
* the KV cache of ``batch_size`` sequences of ``max_tokens`` tokens (at most, and by default,
  ``max_position_embeddings``: the window ``dufu generate`` keeps), for every layer, plus one layer's worth that
  ``torch.cat`` holds while it grows;
* activations of the largest forward (``max_tokens`` tokens at once: a long prompt, or the window refilled): six
  hidden-size tensors (residual stream, norm output, Q, attention output, projections), four MLP-width tensors,
  the logits of every position, and the additive attention masks dufu builds with padding or a cached prefix
  ((T, T) and (B, 1, T, T)); torch's fused SDPA kernels (flash attention on the CPU) never hold the
  (B, heads, T, T) scores.

Not counted: the interpreter and torch's own libraries, and the page cache, which is the kernel's (file pages
that no tensor references any more are unmapped, see :mod:`dufu.engine.inference.streaming_source`). docs/inference.md
says how RSS relates to the budget, with measurements (benchmarks/streaming.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from dufu.engine.inference.streaming_source import MappedSafetensors, open_source
from dufu.errors import DufuError
from dufu.models.hf_weights import StoredTensor
from dufu.models.hub import check_source_shape
from dufu.parallel.materialize import ModuleInitializer

# k/M/G/T are powers of 1000 and Ki/Mi/Gi/Ti powers of 1024 (IEC 80000-13), with or without a trailing B.
_PREFIXES = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "t": 1000 ** 4,
             "ki": 1024, "mi": 1024 ** 2, "gi": 1024 ** 3, "ti": 1024 ** 4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*?)b?\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """A memory size in bytes: ``"2GB"`` (2 * 10^9), ``"512MiB"`` (512 * 2^20), ``"1.5G"``, ``"1000000"``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if m is None or m.group(2).lower() not in _PREFIXES:
            raise DufuError(f"{text!r} is not a memory size. Give a number with an optional unit: 2GB, 512MiB, 1.5G "
                            "(k, M, G, T are powers of 1000; Ki, Mi, Gi, Ti powers of 1024; B is optional).")
        value = int(Fraction(m.group(1)) * _PREFIXES[m.group(2).lower()])  # exact: "1.1GB" is 1,100,000,000
    if value <= 0:
        raise DufuError(f"a memory size must be positive, got {text!r}.")
    return value


def format_bytes(n: int) -> str:
    """``"1.50 GiB (1,610,612,736 bytes)"``: readable, and exact."""
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.2f} {unit} ({n:,} bytes)" if unit != "B" else f"{n:,} bytes"


@dataclass(frozen=True)
class StreamingPlan:
    """What a budget holds: byte counts of the model's parts (see the module docstring) and which blocks are
    resident or streamed."""

    budget: int
    directory: str                   # the safetensors the streamed blocks are read from
    fixed_bytes: int                 # parameters outside the blocks, and every buffer
    block_bytes: dict[str, int]      # each block's parameters, by its key in ``model.blocks``
    slot_bytes: dict[str, int]       # what each block takes while it is streamed in
    kv_cache_bytes: int
    activation_bytes: int
    batch_size: int
    max_tokens: int
    resident_blocks: tuple[str, ...] = field(default=())
    streamed_blocks: tuple[str, ...] = field(default=())

    @property
    def minimum_bytes(self) -> int:
        """The smallest budget that streams: resident parts, the largest slot, the cache and activations."""
        slot = max(self.slot_bytes.values(), default=0)
        return self.fixed_bytes + slot + self.kv_cache_bytes + self.activation_bytes

    @property
    def streaming_bytes(self) -> int:
        return max((self.slot_bytes[b] for b in self.streamed_blocks), default=0)

    @property
    def resident_bytes(self) -> int:
        """Bytes of parameters and buffers the model holds between forwards."""
        return self.fixed_bytes + sum(self.block_bytes[b] for b in self.resident_blocks)

    @property
    def resident_share(self) -> int:
        """What the budget leaves for resident tensors after the cache, activations and the streaming slot."""
        return self.budget - self.kv_cache_bytes - self.activation_bytes - self.streaming_bytes

    def describe(self) -> str:
        n = len(self.block_bytes)
        return (f"memory budget {format_bytes(self.budget)}: {len(self.resident_blocks)} of {n} blocks resident, "
                f"{len(self.streamed_blocks)} streamed from the memory map of {self.directory}; resident "
                f"{format_bytes(self.resident_bytes)}, streaming slot {format_bytes(self.streaming_bytes)}, KV cache "
                f"{format_bytes(self.kv_cache_bytes)} and activations {format_bytes(self.activation_bytes)} "
                f"(batch {self.batch_size}, {self.max_tokens:,} tokens)")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.dtype.itemsize


def _kept_as_view(reader, weights: MappedSafetensors, target: torch.Tensor, device: torch.device) -> bool:
    """True when the stored tensor itself can be the parameter: stored as-is, in its dtype, used on the CPU."""
    return (isinstance(reader, StoredTensor) and device.type == "cpu"
            and weights.dtype(reader.key) == target.dtype)


def _plan(model: nn.Module, source: dict, weights: MappedSafetensors, budget: int, device: torch.device,
          batch_size: int, max_tokens: int) -> StreamingPlan:
    """Count the parts (nothing is read) and choose the resident blocks: in order, as many as fit."""
    blocks = {k: {f"blocks.{k}.{n}": p for n, p in b.named_parameters()} for k, b in model.blocks.items()}
    in_block = {n for params in blocks.values() for n in params}
    fixed = sum(_nbytes(p) for n, p in model.named_parameters() if n not in in_block)
    fixed += sum(_nbytes(b) for _, b in model.named_buffers())
    block_bytes = {k: sum(_nbytes(p) for p in params.values()) for k, params in blocks.items()}
    stored = max(d.itemsize for d in weights.dtypes())  # bytes per element of a copied tensor's source, at most
    slot_bytes = {k: sum(_nbytes(p) if _kept_as_view(source[n], weights, p, device)
                         else _nbytes(p) + p.numel() * stored for n, p in params.items())
                  for k, params in blocks.items()}
    e, B, T, C = next(model.parameters()).dtype.itemsize, batch_size, max_tokens, model.hidden_size
    # blocks may differ (a pruned model): the cache sums them, the activations take the widest
    layer_kv = [2 * B * b.attn.num_key_value_heads * b.attn.head_dim * T * e for b in model.blocks.values()]
    kv = sum(layer_kv) + max(layer_kv)  # (B, nkv, T, hs) keys and values per layer, one more while torch.cat grows
    F = max(m.out_features for m in model.blocks.modules() if isinstance(m, nn.Linear))  # the MLP's width
    # torch's fused SDPA kernels never hold the (B, heads, T, T) scores; dufu's attention builds additive masks,
    # (T, T) causal and (B, 1, T, T) with padding, when there is padding or a cached prefix
    act = e * B * T * (6 * C + 4 * F + model.vocab_size) + e * (B + 1) * T * T
    plan = dict(budget=budget, directory=str(weights.path), fixed_bytes=fixed, block_bytes=block_bytes,
                slot_bytes=slot_bytes, kv_cache_bytes=kv, activation_bytes=act, batch_size=B, max_tokens=T)
    if fixed + sum(block_bytes.values()) + kv + act <= budget:
        return StreamingPlan(**plan, resident_blocks=tuple(block_bytes))
    probe = StreamingPlan(**plan)
    if budget < probe.minimum_bytes:
        worst = max(slot_bytes, key=slot_bytes.get)
        raise DufuError(
            f"a memory budget of {format_bytes(budget)} is below the minimum of {format_bytes(probe.minimum_bytes)} "
            f"this {type(model).__name__} needs to stream its blocks: embeddings, norms, head and buffers "
            f"{format_bytes(fixed)} + one streamed block {format_bytes(slot_bytes[worst])} + KV cache "
            f"{format_bytes(kv)} + activations {format_bytes(act)} (batch {B}, {T:,} tokens). Raise --max-memory to "
            "at least that, or reserve fewer tokens: shorter prompts and fewer new tokens (load_streaming's "
            "max_tokens).")
    left = budget - fixed - kv - act - max(slot_bytes.values())
    resident = []
    for k in block_bytes:
        if block_bytes[k] > left:
            break
        resident.append(k)
        left -= block_bytes[k]
    streamed = tuple(k for k in block_bytes if k not in resident)
    return StreamingPlan(**plan, resident_blocks=tuple(resident), streamed_blocks=streamed)


class _StreamedBlock:
    """The hooks of one streamed block: its parameters are read in before each forward and dropped after."""

    def __init__(self, block: nn.Module, prefix: str, source: dict, weights: MappedSafetensors,
                 device: torch.device, what: str):
        self.weights, self.device, self.what = weights, device, what
        self.slots = []  # (owning module, leaf name, reader, keep the view, the meta parameter, full name)
        for name, p in block.named_parameters():
            path, _, leaf = name.rpartition(".")
            reader = source[prefix + name]
            self.slots.append((block.get_submodule(path), leaf, reader, _kept_as_view(reader, weights, p, device), p,
                               prefix + name))

    @torch.no_grad()
    def load(self, block: nn.Module, args) -> None:
        with self.weights.reading():  # one handle for the block's reads; closed before the block runs
            for owner, leaf, reader, as_view, meta, name in self.slots:
                value = reader()
                check_source_shape(self.what, block, name, value, meta)
                if not as_view:
                    value = value.to(device=self.device, dtype=meta.dtype)
                setattr(owner, leaf, nn.Parameter(value, requires_grad=False))

    def drop(self, block: nn.Module, args, output) -> None:
        for owner, leaf, _, _, meta, _ in self.slots:
            setattr(owner, leaf, meta)  # the streamed tensors lose their last reference here


class _ReservationCheck:
    """Refuses a forward that would outgrow what the budget reserved (batch size, tokens in the cache): the
    plan's promise would silently break otherwise."""

    def __init__(self, model: nn.Module, plan: StreamingPlan):
        self.first_attn, self.plan = next(iter(model.blocks.values())).attn, plan

    def __call__(self, model: nn.Module, args, kwargs) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        cache = kwargs.get("kv_cache")
        cached = cache.get(self.first_attn) if cache is not None else None
        B, T = ids.shape[0], ids.shape[1] + (0 if cached is None else cached[0].shape[2])  # cached: (B, nkv, S, hs)
        if B > self.plan.batch_size or T > self.plan.max_tokens:
            raise DufuError(f"this forward needs {B} sequence(s) of {T:,} tokens, but the memory budget reserved the "
                            f"KV cache and activations of {self.plan.batch_size} of {self.plan.max_tokens:,}. Load "
                            "with larger batch_size / max_tokens (load_streaming), or generate fewer tokens.")


@torch.no_grad()
def _materialise_resident(model: nn.Module, plan: StreamingPlan, source: dict, device: torch.device,
                          what: str) -> None:
    """Read the resident parameters into private memory (copies: a view would leave their pages to the page cache,
    which may drop them under memory pressure and read them again); compute buffers the source lacks."""
    streamed = tuple(f"blocks.{k}." for k in plan.streamed_blocks)
    for name, p in list(model.named_parameters()):  # a tied head is its embedding's tensor: listed once
        if name.startswith(streamed):
            continue
        reader = source[name]
        value = reader()
        check_source_shape(what, model, name, value, p)
        value = value.to(device=device, dtype=p.dtype, copy=isinstance(reader, StoredTensor))
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=False))
        del value, reader
    init = ModuleInitializer(model, seed=0)  # buffers hold computed tables (rotary frequencies), not random values
    for name, b in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        value = source[name]() if name in source else init.values(owner)[leaf]
        model.get_submodule(owner)._buffers[leaf] = value.to(device=device, dtype=b.dtype, copy=True)
    model.tie_weights()


def _build(source_path: str | Path, max_memory: str | int, device, batch_size: int, max_tokens: Optional[int]):
    budget = parse_bytes(max_memory)
    if batch_size < 1 or (max_tokens is not None and max_tokens < 1):
        raise DufuError(f"batch_size ({batch_size}) and max_tokens ({max_tokens}) must be positive.")
    model, source, weights, what = open_source(source_path)
    # no sequence is longer than max_position_embeddings: generate() keeps a window of that many
    tokens = min(max_tokens or model.max_position_embeddings, model.max_position_embeddings)
    plan = _plan(model, source, weights, budget, torch.device(device), batch_size, tokens)
    return model, plan, source, weights, what


def plan_streaming(source: str | Path, max_memory: str | int, device: str | torch.device = "cpu", *,
                   batch_size: int = 1, max_tokens: Optional[int] = None) -> StreamingPlan:
    """What :func:`load_streaming` would keep resident and stream, without materialising the model (a source that
    needs converting, see :mod:`dufu.engine.inference.streaming_source`, is converted first)."""
    return _build(source, max_memory, device, batch_size, max_tokens)[1]


def load_streaming(source: str | Path, max_memory_bytes: str | int, device: str | torch.device = "cpu", *,
                   batch_size: int = 1, max_tokens: Optional[int] = None) -> nn.Module:
    """A decoder (GPT, LLaMA, Qwen2) in eval mode that holds at most ``max_memory_bytes`` (a number or a string for
    :func:`parse_bytes`) of tensors while it generates, streaming the blocks that do not fit from the
    memory-mapped safetensors of ``source`` (a Hugging Face directory or a dufu run: see
    :mod:`dufu.engine.inference.streaming_source`). ``batch_size`` and ``max_tokens`` (default, and at most,
    ``max_position_embeddings``) size the KV cache and activations the budget reserves. A budget below the minimum
    is a DufuError that names it. ``model.streaming_plan`` says what was kept (:class:`StreamingPlan`)."""
    device = torch.device(device)
    model, plan, source_map, weights, what = _build(source, max_memory_bytes, device, batch_size, max_tokens)
    _materialise_resident(model, plan, source_map, device, what)
    model.streaming_hooks = []
    for key in plan.streamed_blocks:
        block = model.blocks[key]
        for p in block.parameters():
            p.requires_grad_(False)
        hooks = _StreamedBlock(block, f"blocks.{key}.", source_map, weights, device, what)
        model.streaming_hooks += [block.register_forward_pre_hook(hooks.load),
                                  block.register_forward_hook(hooks.drop, always_call=True)]
    model.streaming_hooks.append(model.register_forward_pre_hook(_ReservationCheck(model, plan), with_kwargs=True))
    model.streaming_plan = plan
    return model.eval()
